"""The servers `triode bench llamacpp` runs: their command lines and requests, and
`open_measured_server`, which starts one and measures its start time and its process tree's
memory while it runs.

llama.cpp's own C++ server, `llama-server`, batches its `--parallel` slots continuously; each
slot holds `--ctx-size / --parallel` tokens of context. It takes triode's request as it is
(`ignore_eos`, `max_tokens`, `stream_options.include_usage`), so both are asked and counted the
same way, by one client (`run_workload`). llama-cpp-python's OpenAI server runs one request
at a time and has no `ignore_eos`: it is asked for `min_tokens` = `max_tokens` and counted from
its stream.
"""

from __future__ import annotations

import math
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from .completion_stream import RequestResult, stream_completion
from .process_tree import PeakMemory, ProcessTree
from .serve import WARMUP_PROMPT, _drive, first_model_id, summarize
from .server_process import _stop, serve_command, wait_until_healthy

LLAMA_SERVER = "llama-server"
LLAMACPP_PYTHON = "llama-cpp-python"
TRIODE = "triode"

# llama-cpp-python's server with the `GET /health` that the start waits for: it loads the model
# before it listens, so a server that answers at all is ready
LLAMACPP_PYTHON_SERVE = """
import runpy, sys
from llama_cpp.server.app import router
router.add_api_route("/health", lambda: {}, methods=["GET"])
sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def slot_context(input_len: int, output_len: int) -> int:
    """Tokens of context per llama-server slot for a prompt of `input_len` words (a word is
    one or two tokens) and `output_len` new tokens, in whole 256-token blocks."""
    return 256 * math.ceil((2 * input_len + output_len + 16) / 256)


def llama_server_command(
    binary: str, model: Path, port: int, *, streams: int, threads: int, slot_ctx: int
) -> list[str]:
    """llama-server on `model` with a slot per stream, `slot_ctx` tokens each."""
    return [binary, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(streams), "--ctx-size", str(streams * slot_ctx),
            "--threads", str(threads), "--threads-batch", str(threads),
            "--no-webui"]  # fmt: skip


def llamacpp_python_command(python: str, model: Path, port: int, *, threads: int) -> list[str]:
    """llama-cpp-python's OpenAI server on `model`, run by `python`."""
    return [python, "-c", LLAMACPP_PYTHON_SERVE, "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
            "--n_threads", str(threads), "--n_threads_batch", str(threads),
            # by default a request arriving ends the one streaming, and each prints its timings
            "--interrupt_requests", "False", "--verbose", "False"]  # fmt: skip


def triode_command(model: Path, port: int, *, max_model_len: int) -> list[str]:
    """`triode serve` on `model`, each request's context `max_model_len` tokens at most, as
    llama-server's slots (triode's default, the model's own, can need more KV cache than its
    default budget holds)."""
    return [*serve_command(str(model), port), "--max-model-len", str(max_model_len)]


def completion_body(model: str, prompt: str, output_len: int) -> dict[str, Any]:
    """A greedy completion of exactly `output_len` tokens as triode and llama-server take it
    (`bench serve`'s), its usage at the end of the stream."""
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def llamacpp_python_body(model: str, prompt: str, output_len: int) -> dict[str, Any]:
    """A greedy completion of exactly `output_len` tokens, as llama-cpp-python's server takes
    one (`min_tokens` in place of `ignore_eos`, the repetition penalty off as triode's is)."""
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "temperature": 0, "repeat_penalty": 1.0, "stream": True}  # fmt: skip


async def run_workload(
    base_url: str,
    body: Callable[[str, str, int], dict[str, Any]],
    *,
    prompts: list[str],
    output_len: int,
    max_concurrency: int,
    counted: bool = False,
) -> dict[str, Any]:
    """`bench serve`'s workload and summary: a completion (`body(model, prompt, max_tokens)`)
    streamed for every prompt, `max_concurrency` at a time, after one unmeasured warm-up
    request; `counted` counts tokens from the stream, for a server whose stream has no usage.

    Each request opens a connection of its own: llama-server at times closes a connection after
    a streamed response, and a request sent on it fails without a response. Raises
    `RuntimeError` if the warm-up fails and `httpx.HTTPError` if the server cannot be
    reached."""
    limits = httpx.Limits(max_connections=max_concurrency + 1, max_keepalive_connections=0)
    timeout = httpx.Timeout(30.0, read=None, pool=None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        model = await first_model_id(client)

        def one(prompt: str, max_tokens: int = output_len) -> Awaitable[RequestResult]:
            return stream_completion(client, body(model, prompt, max_tokens), counted=counted)

        warmup = await one(WARMUP_PROMPT, min(output_len, 4))
        if not warmup.ok:
            raise RuntimeError(f"the warm-up request failed: {warmup.error}")
        results, duration = await _drive(prompts, one, max_concurrency, math.inf, 0)
    return {"base_url": base_url, "model": model, **summarize(results, duration)}


@dataclass
class MeasuredServer:
    process: trio.Process
    memory: PeakMemory
    start_s: float  # from starting the process to its first `GET /health` 200


@asynccontextmanager
async def open_measured_server(
    command: list[str], base_url: str, *, ready_timeout: float, stop_timeout: float = 30.0
) -> AsyncIterator[MeasuredServer]:
    """Run the server `command` until `GET {base_url}/health` answers 200, then yield it, its
    process tree's memory sampled from the start on (phase `start` until ready).

    Leaving the block stops the server as `server_process.open_server` does (SIGINT, then after
    `stop_timeout` seconds SIGKILL to its process group) and then kills whatever of its tree
    outside that group still runs. Raises, in an `ExceptionGroup` (the sampling runs in a
    nursery around the block, so the block's own errors come in one too), `RuntimeError` (with
    the end of the server's output) if it exits before it is ready and `TimeoutError` if it is
    not ready within `ready_timeout` seconds.
    """
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        process = await trio.lowlevel.open_process(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        memory = PeakMemory(ProcessTree(process.pid))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(memory.run)
                try:
                    # polled often: llama-server loads a small file in well under a second
                    await wait_until_healthy(process, base_url, ready_timeout, log, poll=0.05)
                    yield MeasuredServer(process, memory, time.perf_counter() - started)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await _stop(process, stop_timeout)
                memory.tree.end()
