"""The `triode` command's entry point: the command line (`cli.main`), loaded and run with an
interrupt that comes before the server handles its own (Ctrl-C while Python loads the modules,
in the first fraction of a second) ending it quietly with exit status 130, as a shell does."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        # the command line's modules load here, where an interrupt is caught
        from .cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        print("triode: interrupted", file=sys.stderr)
        return 130
