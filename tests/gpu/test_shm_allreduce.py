"""The shared-memory all-reduce between real rank processes joined by gloo over 127.0.0.1.

Each test starts a world of rank processes (one torch thread each) that run one scenario and
pickle what they saw; the assertions run here, in the parent, which also checks that no rank
outlives the test and nothing stays in /dev/shm.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from triode.gpu.local_group import free_port

pytestmark = pytest.mark.slow

CASES = [(1, 576), (64, 576), (7, 13), (5,), (), (0, 576)]
DTYPES = [torch.float32, torch.bfloat16]
CONSECUTIVE = 100
JOIN_TIMEOUT = 120.0


def _input(rank: int, case: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randn(shape, generator=generator).to(dtype)


def _rank_order_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].float().clone()
    for t in tensors[1:]:
        total += t.float()
    return total.to(tensors[0].dtype)


# What the ranks run. Each gets (rank, world) and returns something picklable.


def _sums(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from triode.gpu.shm_allreduce import SHM_DIR, ShmAllReduce

    results: dict[str, Any] = {}
    with ShmAllReduce.create(dist.group.WORLD, max_bytes=1 << 20, timeout=30) as ar:
        results["name"] = ar.name
        results["unlinked"] = not (SHM_DIR / ar.name).exists()
        case = 0
        for dtype in DTYPES:
            for shape in CASES:
                y = _input(rank, case, shape, dtype)
                ar.all_reduce(y)
                results[f"case {case}"] = y
                case += 1
        transposed = _input(rank, case, (576, 3), torch.float32).t()
        ar.all_reduce(transposed)
        results["transposed"] = transposed
        # many calls back to back, of changing sizes, go through both buffers
        results["consecutive"] = []
        for i in range(CONSECUTIVE):
            y = _input(rank, 100 + i, (1 + i % 5, 576), DTYPES[i % 2])
            ar.all_reduce(y)
            results["consecutive"].append(y)
        x = _input(rank, 999, (64, 576), torch.float32)
        shm, gloo = x.clone(), x.clone()
        ar.all_reduce(shm)
        dist.all_reduce(gloo)
        results["gloo_diff"] = (shm - gloo).abs().max().item()
    return results


def _idle_peer(rank: int, world: int) -> tuple[str, str, float, str] | None:
    import torch.distributed as dist

    from triode.gpu.shm_allreduce import ShmAllReduce

    with ShmAllReduce.create(dist.group.WORLD, max_bytes=4096, timeout=1.5) as ar:
        ar.all_reduce(torch.ones(4))
        if rank == world - 1:
            time.sleep(4.0)  # alive, but never calls
            return None
        start = time.monotonic()
        try:
            ar.all_reduce(torch.ones(4))
        except Exception as e:
            waited = time.monotonic() - start
            try:
                ar.all_reduce(torch.ones(4))
            except Exception as again:
                return type(e).__name__, str(e), waited, type(again).__name__
            return type(e).__name__, str(e), waited, "no error"
        return "no error", "", time.monotonic() - start, ""


def _killed_peer(rank: int, world: int) -> tuple[str, str, float, str]:
    import torch.distributed as dist

    from triode.gpu.shm_allreduce import ShmAllReduce

    with ShmAllReduce.create(dist.group.WORLD, max_bytes=4096, timeout=30) as ar:
        ar.all_reduce(torch.ones(4))
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            ar.all_reduce(torch.ones(4))
        except Exception as e:
            return type(e).__name__, str(e), time.monotonic() - start, ar.name
        return "no error", "", time.monotonic() - start, ar.name


def _unmappable_on_rank_1(rank: int, world: int) -> tuple[str, str, list[str]]:
    """(what `create` did, its message, the names of the segments this rank made)."""
    import secrets

    import torch.distributed as dist

    from triode.gpu import shm_allreduce

    made: list[str] = []

    class _Named:
        @staticmethod
        def token_hex(nbytes: int) -> str:
            made.append(shm_allreduce.NAME_PREFIX + secrets.token_hex(nbytes))
            return made[-1].removeprefix(shm_allreduce.NAME_PREFIX)

    shm_allreduce.secrets = _Named  # type: ignore[assignment]
    if rank == 1:
        shm_allreduce.SHM_DIR = Path("/nonexistent-triode-shm")
    try:
        shm_allreduce.ShmAllReduce.create(dist.group.WORLD, max_bytes=4096, timeout=5).close()
    except shm_allreduce.ShmUnavailable as e:
        return "ShmUnavailable", str(e), made
    return "created", "", made


def _tp_all_reduce_paths(rank: int, world: int, port: int, env: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    from triode.gpu import parallel_state

    if env is not None:
        os.environ["TRIODE_SHM_ALLREDUCE"] = env
    state = parallel_state.init_distributed(
        parallel_state.ParallelLayout(tp_size=world, rank=rank),
        master_addr="127.0.0.1",
        master_port=port,
        device=torch.device("cpu"),
        collective_timeout=30,
        shm_all_reduce_bytes=4096,
    )
    gloo_calls = 0
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal gloo_calls
        gloo_calls += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    seen: dict[str, Any] = {"shm": state.tp_shm is not None}
    try:
        for label, tensor in [
            ("small", torch.full((2, 512), rank + 1.0)),  # 4096 bytes: fits
            ("big", torch.full((2, 513), rank + 1.0)),
            ("int", torch.full((4,), rank + 1)),
        ]:
            before = gloo_calls
            out = parallel_state.tp_all_reduce(tensor)
            seen[label] = (gloo_calls - before, out is tensor, tensor.unique().tolist())
    finally:
        dist.all_reduce = all_reduce
        dist.barrier()
        parallel_state.destroy_distributed()
    return seen


# The harness


def _rank_main(
    scenario: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out: str,
    join: bool,
    extra: tuple[Any, ...],
) -> None:
    """`join`: the scenario runs in a gloo world made here; else it gets the port and joins
    the world itself."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if join:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    try:
        args = extra if join else (port, *extra)
        result = scenario(rank, world, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if join:
            dist.destroy_process_group()


def _run(
    scenario: Callable[..., Any],
    world: int,
    tmp_path: Path,
    *,
    join: bool = True,
    extra: tuple[Any, ...] = (),
    expect_killed: frozenset[int] = frozenset(),
) -> list[Any]:
    """Every rank's result (None for a rank that was killed), once every rank is gone."""
    # forked by multiprocessing's fork server, which imported torch once (effective at the
    # call that starts it, in this worker or in gpu.local_group's `run_ranks`)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", __name__])
    port = free_port()
    out = str(tmp_path)
    procs = [
        ctx.Process(target=_rank_main, args=(scenario, r, world, port, out, join, extra))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for p in procs:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)  # type: ignore[arg-type]
    errors = {r: f.read_text() for r in range(world) if (f := Path(out, f"{r}.err")).exists()}
    assert not errors, errors
    codes = [p.exitcode for p in procs]
    assert codes == [-signal.SIGKILL if r in expect_killed else 0 for r in range(world)]
    return [
        None if r in expect_killed else pickle.loads(Path(out, f"{r}.pkl").read_bytes())
        for r in range(world)
    ]


def _assert_gone(name: str) -> None:
    from triode.gpu.shm_allreduce import SHM_DIR

    assert not (SHM_DIR / name).exists()


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_float32_rank_order_sum_bit_for_bit(world: int, tmp_path: Path) -> None:
    results = _run(_sums, world, tmp_path)

    case = 0
    for dtype in DTYPES:
        for shape in CASES:
            want = _rank_order_sum([_input(r, case, shape, dtype) for r in range(world)])
            for got in results:
                assert got[f"case {case}"].dtype == dtype
                assert torch.equal(got[f"case {case}"], want), (dtype, shape)
            case += 1
    want = _rank_order_sum([_input(r, case, (576, 3), torch.float32).t() for r in range(world)])
    for got in results:
        assert torch.equal(got["transposed"], want)
    for i in range(CONSECUTIVE):
        shape, dtype = (1 + i % 5, 576), DTYPES[i % 2]
        want = _rank_order_sum([_input(r, 100 + i, shape, dtype) for r in range(world)])
        for got in results:
            assert torch.equal(got["consecutive"][i], want), i
    for got in results:
        assert got["gloo_diff"] <= 1e-6
        assert got["unlinked"]
    assert len({got["name"] for got in results}) == 1
    _assert_gone(results[0]["name"])


def test_a_rank_that_never_calls_times_the_others_out_for_good(tmp_path: Path) -> None:
    results = _run(_idle_peer, 3, tmp_path)

    assert results[2] is None
    for rank in (0, 1):
        kind, message, waited, next_call = results[rank]
        assert kind == "TimeoutError"
        assert "ranks [2]" in message
        assert 1.5 <= waited <= 2.0
        assert next_call == "RuntimeError"  # the ranks' call counts no longer agree


def test_a_killed_rank_is_reported_gone_well_before_the_timeout(tmp_path: Path) -> None:
    results = _run(_killed_peer, 2, tmp_path, expect_killed=frozenset({1}))

    kind, message, waited, name = results[0]
    assert kind == "RuntimeError"
    assert "tensor-parallel rank 1 (pid " in message and "is gone" in message
    assert waited < 1.0  # the timeout is 30 s
    _assert_gone(name)


def test_a_rank_that_cannot_map_the_segment_makes_every_rank_fall_back(tmp_path: Path) -> None:
    results = _run(_unmappable_on_rank_1, 2, tmp_path)

    assert [kind for kind, _, _ in results] == ["ShmUnavailable", "ShmUnavailable"]
    assert "rank 1 could not map" in results[1][1]
    [made] = results[0][2]  # rank 0 made the segment, and unlinked it
    _assert_gone(made)


def test_tp_all_reduce_uses_gloo_for_what_does_not_fit(tmp_path: Path) -> None:
    results = _run(_tp_all_reduce_paths, 2, tmp_path, join=False, extra=(None,))

    for seen in results:
        assert seen["shm"]
        assert seen["small"] == (0, True, [3.0])
        assert seen["big"] == (1, True, [3.0])
        assert seen["int"] == (1, True, [3])


def test_tp_all_reduce_is_all_gloo_when_turned_off(tmp_path: Path) -> None:
    results = _run(_tp_all_reduce_paths, 2, tmp_path, join=False, extra=("0",))

    for seen in results:
        assert not seen["shm"]
        assert seen["small"] == (1, True, [3.0])
