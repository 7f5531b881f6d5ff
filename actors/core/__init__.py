"""The engine core's process: the step loop, the scheduler and its KV cache, the executor that
drives the model's ranks, and the publisher that fans outputs out to subscribers. Nothing here
runs in a caller's process.
"""
