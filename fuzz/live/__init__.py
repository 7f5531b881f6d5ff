"""The live fuzzer: hostile traffic against a running server over HTTP (`http_fuzzer`, which
sends what `http_mutator` draws, byte for byte, through `raw_http`) and against an engine core
over ZMQ (`zmq_fuzzer`, sending what `zmq_mutator` draws), with invariants checked between
rounds. `main` is `triode fuzz` and `python -m triode.fuzz.live` (`cli`); both modes share the
`report` of a run and the watch on the `processes` under test."""

from .cli import main as main
