"""How the suite is spread over pytest-xdist's workers (`make test` runs `-n 2`, scheduled by
`pytest_xdist_make_scheduler` below): a module runs whole on one worker, so its module-scoped
servers start once; modules whose checks see a machine-wide resource form one group and run on
one worker.

Each worker, and every process it starts, runs on a share of the machine's CPUs of its own:
the model processes size their thread pools to the CPUs they may use, so that two workers'
models never put more threads than cores to work, where every OpenMP barrier would wait for a
thread the kernel descheduled.

Each worker starts the model processes (engine cores, workers) of its tests, and of the servers
its tests launch, from a fork server of its own (`triode.actors.forkserver`): torch,
transformers and triode are imported once per worker, not once per process. A module that
looks at its servers' process tree (whose children an actor is, its command line) sets
`EXECUTED_ACTORS = True`: its actors are executed as without a fork server."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from processes import RankPool

from triode.actors.forkserver import ENV as FORKSERVER_ENV
from triode.actors.forkserver import Forkserver
from triode.actors.model_env import model_process_env

# The modules that make shared tensors (/dev/shm/triode_tensor_*: prompt embeddings, weight
# updates; the fuzzers send prompt embeddings too), and those whose checks say that none
# outlives a test: on one worker, no other test's segment shows up in a check.
SHARED_TENSORS = frozenset({
    "tests/fuzz/test_harnesses.py",
    "tests/fuzz/live/test_live.py",
    "tests/fuzz/live/test_chaos.py",
    "tests/wire/test_tensor_ipc.py",
    "tests/wire/test_weight_update.py",
    "tests/gpu/test_weight_transfer.py",
    "tests/gpu/test_operations.py",
    "tests/gpu/test_operations_parallel.py",
    "tests/actors/test_prompt_embeds_engine.py",
    "tests/actors/core/test_engine_operations.py",
    "tests/edge/completions/test_prompt_embeds.py",
    "tests/edge/test_admin_routes.py",
    "tests/integration/test_weight_sync.py",
    "tests/integration/test_admin_operations.py",
    "tests/integration/test_server_errors.py",
    "tests/integration/test_scale_out.py",
})  # fmt: skip


def _worker_cpus() -> list[int] | None:
    """This xdist worker's equal, contiguous share of the CPUs; None outside xdist, or with
    fewer CPUs than workers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return None
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    cpus = sorted(os.sched_getaffinity(0))
    per_worker = len(cpus) // count
    if per_worker == 0:
        return None
    index = int(worker.removeprefix("gw"))
    return cpus[index * per_worker : (index + 1) * per_worker]


if (_cpus := _worker_cpus()) is not None:
    os.sched_setaffinity(0, _cpus)


def _group(module: str) -> str:
    if module in SHARED_TENSORS:
        return "shared-tensors"
    return module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduler, handing each worker a whole group at a time. (Its `loadgroup` mode
    names groups by a suffix it writes into each item's node id, which pytest 9's node ids no
    longer take: the groups were silently ignored, modules split over both workers.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0])

    return ModuleGroups(config, log)


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    """Four spawned processes for the worlds of rank processes a worker's modules run."""
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture
def own_children() -> Callable[[], list[multiprocessing.process.BaseProcess]]:
    """The multiprocessing children started during the test that still run: the session's rank
    pool, started before, is not the test's."""
    before = {p.pid for p in multiprocessing.active_children()}
    return lambda: [p for p in multiprocessing.active_children() if p.pid not in before]


@pytest.fixture(scope="session", autouse=True)
def forkserver() -> Iterator[Forkserver]:
    """The worker's fork server, in the environment the model processes get."""
    server = Forkserver({**os.environ, **model_process_env(os.environ)}).start()
    os.environ[FORKSERVER_ENV] = server.path
    yield server
    os.environ.pop(FORKSERVER_ENV, None)
    server.close()


@pytest.fixture(scope="module", autouse=True)
def actor_start(request: pytest.FixtureRequest, forkserver: Forkserver) -> Iterator[None]:
    """Forked actors, or executed ones for a module with `EXECUTED_ACTORS = True`."""
    if not getattr(request.module, "EXECUTED_ACTORS", False):
        yield
        return
    os.environ.pop(FORKSERVER_ENV)
    yield
    os.environ[FORKSERVER_ENV] = forkserver.path
