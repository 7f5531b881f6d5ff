"""triode.fuzz: harnesses that throw hostile bytes at every decoder and parser, and a live fuzzer
for a running server (HTTP) and engine core (ZMQ)."""
