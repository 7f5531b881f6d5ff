"""Benchmarks of the model's process: one engine step, the collectives, and KV-cache transfer; and
the transformers baseline they compare against.
"""
