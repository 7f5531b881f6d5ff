"""Served benchmarks: `triode bench serve`, `ab`, `frontend`, `vllm`, `throughput` and
`structured`, and `triode serve` as a child process for them, the fuzzers and the tests.
"""
