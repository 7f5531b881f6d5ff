"""triode.edge: what users talk to — the `triode` command line (and, to come, the HTTP edge)."""
