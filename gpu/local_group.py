"""A torch.distributed process group of ranks on this machine, for checks and benchmarks.

`run_ranks` starts one process per rank, joins them into a group over TCP on 127.0.0.1, runs a
target in each and returns what every rank returned. The ranks come from multiprocessing's fork
server, which imported torch and the first target's module once (a rank then starts in a
fraction of a second, not after 2-3 s of imports) and never initializes CUDA (which cannot
survive a fork). The fork server starts with this process's environment at the first call; a
variable set later does not reach the ranks. The engine's workers have their own process
management; this is the smallest harness that gets `world` real ranks talking, and it never
leaves one behind.
"""

from __future__ import annotations

import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from triode.wire.ports import free_port


@dataclass(frozen=True)
class Rank:
    """Where a target runs: its rank, the group's size, and the device its tensors live on."""

    rank: int
    world: int
    device: torch.device


class RankError(RuntimeError):
    """One or more ranks raised or died; `tracebacks` holds what each rank that raised said."""

    def __init__(self, message: str, tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.tracebacks = tracebacks


@dataclass(frozen=True)
class _Spec:
    target: Callable[..., Any]
    args: tuple[Any, ...]
    backend: str
    world: int
    port: int
    threads: int | None
    timeout: float


def run_ranks(
    target: Callable[..., Any],
    *args: Any,
    backend: str,
    world: int,
    threads: int | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """Run `target(Rank, *args)` in `world` processes joined by `backend`; rank order results.

    `target` and `args` must pickle (a module-level function). With `backend="nccl"`, rank r
    runs on `cuda:r`; with gloo, on the CPU. `threads` sets each rank's torch thread count.
    `timeout` bounds the whole run and each collective. Raises RankError, with every failed
    rank's traceback, when a rank raises or dies, and TimeoutError after `timeout` seconds;
    either way every rank is dead when this returns or raises.
    """
    spec = _Spec(target, args, backend, world, free_port(), threads, timeout)
    # effective at the first call only, which starts the fork server
    mp.set_forkserver_preload(["torch.distributed", __name__, target.__module__])
    with tempfile.TemporaryDirectory(prefix="triode-ranks-") as outdir:
        context = mp.start_processes(
            _rank_main, args=(spec, outdir), nprocs=world, join=False, start_method="forkserver"
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{world} {backend} ranks still running after {timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # torch names only the first rank to exit, often a peer that lost its connection
            # to the rank that actually failed: report every rank's own traceback.
            tracebacks = {
                r: path.read_text()
                for r in range(world)
                if (path := Path(outdir, f"{r}.err")).is_file()
            }
            raise RankError(_summary(backend, tracebacks, e), tracebacks) from e
        finally:
            # join() already reaps every rank on success and on a rank's failure; this is for
            # the timeout and for an interrupt of the parent.
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        return [pickle.loads(Path(outdir, f"{r}.pkl").read_bytes()) for r in range(world)]


def _rank_main(rank: int, spec: _Spec, outdir: str) -> None:
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if spec.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    failure = Path(outdir, f"{rank}.err")
    with _traceback_to(failure):
        dist.init_process_group(
            spec.backend,
            init_method=f"tcp://127.0.0.1:{spec.port}",
            rank=rank,
            world_size=spec.world,
            timeout=timedelta(seconds=spec.timeout),
            device_id=device if device.type == "cuda" else None,
        )
    try:
        # Inside the group's lifetime: the traceback is on disk before any peer fails for
        # want of this rank.
        with _traceback_to(failure):
            result = spec.target(Rank(rank, spec.world, device), *spec.args)
    finally:
        if dist.is_initialized():  # the target may have torn its world down itself
            dist.destroy_process_group()
    Path(outdir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


@contextmanager
def _traceback_to(path: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        path.write_text(traceback.format_exc())
        raise


def _summary(backend: str, tracebacks: dict[int, str], cause: BaseException) -> str:
    if not tracebacks:
        return f"a {backend} rank died: {cause}"
    parts = [f"rank {r} raised:\n{text.rstrip()}" for r, text in sorted(tracebacks.items())]
    return f"{backend} ranks failed\n" + "\n".join(parts)
