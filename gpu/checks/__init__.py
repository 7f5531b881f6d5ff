"""Checks of a machine's devices and collectives: NCCL and gloo collectives, tensor-parallel
decoding, run by `make device-check`; and of a model's files before it is served (`model.py`).
"""
