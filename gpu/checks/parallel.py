"""Greedy decoding of tensor- and pipeline-parallel worlds against a world of one.

`check_parallel_greedy(model, shapes, backend)` runs the model runner itself on every rank of
each world (`local_group.run_ranks`; nccl: rank r on cuda:r, gloo: CPU), as the engine's
workers do but without the engine: every rank executes the same hand-built `SchedulerOutput`s,
a prefill of `PROMPTS` and then greedy decode steps whose tokens the driver rank broadcasts.
With `expert_parallel`, a mixture of experts' experts are split over the TP ranks (TP=2+EP).
A world passes when its driver's greedy tokens equal the world of one's over `MAX_TOKENS`
tokens of every prompt, and every top-`TOP_LOGPROBS` logprob (float32) is within
`LOGPROB_TOLERANCE` of its counterpart.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from triode.wire import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

from .. import object_collectives, parallel_state
from ..local_group import Rank, RankError, run_ranks
from ..model_runner import ModelRunner
from ..parallel_state import ParallelLayout
from .collective import CheckRow, Status

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 5, 8, 13,",
)
MAX_TOKENS = 24
TOP_LOGPROBS = 20
LOGPROB_TOLERANCE = 1e-4
BLOCK_SIZE = 16
MAX_MODEL_LEN = 128
KV_CACHE_MEMORY = 64 << 20
WORLD_TIMEOUT = 300.0  # seconds for one world's start, model load and decode


@dataclass(frozen=True)
class Decoded:
    """The driver rank's output per prompt: greedy token ids, and for each a logprobs row
    (column 0 the chosen token, then the top `TOP_LOGPROBS` in descending order)."""

    tokens: list[list[int]]
    logprobs: list[np.ndarray]  # float32 [tokens, 1 + TOP_LOGPROBS] per prompt


def check_parallel_greedy(
    model: Path,
    shapes: Sequence[tuple[int, int]],
    *,
    backend: str,
    which: str,
    expert_parallel: bool = False,
) -> list[CheckRow]:
    """A row per (TP, PP) shape in `shapes`, each world's greedy decoding of `model` (its
    experts split over the TP ranks with `expert_parallel`) against TP=1's. `which` names the
    model in each row's note. A world whose ranks raise, die or hang is a failed row; so is
    every row when the world of one fails."""
    try:
        prompts = _tokenize(model)
        baseline: Decoded | BaseException = _decode(model, prompts, 1, 1, backend, False)
    except Exception as e:
        print(f"TP=1 failed:\n{e}", file=sys.stderr)
        baseline = e
    rows = []
    for tp, pp in shapes:
        status: Status
        if isinstance(baseline, BaseException):
            status, note = "FAIL", f"TP=1: {_describe(baseline)}"
        else:
            try:
                got = _decode(model, prompts, tp, pp, backend, expert_parallel)
            except Exception as e:
                print(f"{shape_name(tp, pp, expert_parallel)} failed:\n{e}", file=sys.stderr)
                status, note = "FAIL", _describe(e)
            else:
                status, note = compare(got, baseline)
        note = f"{note}, {which}"
        rows.append(greedy_row(tp, pp, backend, status, note, expert_parallel))
    return rows


def greedy_row(
    tp: int, pp: int, backend: str, status: Status, note: str, expert_parallel: bool = False
) -> CheckRow:
    op = f"greedy {shape_name(tp, pp, expert_parallel)} vs TP=1"
    return CheckRow(op, backend, tp * pp, "float32", None, status, None, note)


def shape_name(tp: int, pp: int, expert_parallel: bool = False) -> str:
    if pp == 1:
        return f"TP={tp}" + ("+EP" if expert_parallel else "")
    return f"PP={pp}" if tp == 1 else f"TP={tp}xPP={pp}"


def compare(got: Decoded, want: Decoded) -> tuple[Status, str]:
    """Whether `got` passes against `want`: every prompt's tokens identical and every logprob
    within `LOGPROB_TOLERANCE` (a NaN never is); the note says how close they came."""
    problems = []
    if len(got.tokens) != len(want.tokens):
        problems.append(f"{len(got.tokens)} prompts answered, not {len(want.tokens)}")
    identical = 0
    for i, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=False)):
        if len(a) != MAX_TOKENS:
            problems.append(f"prompt {i} got {len(a)} tokens")
        elif a != b:
            problems.append(f"prompt {i} parts at token {_parting(a, b)}")
        else:
            identical += 1
    differences = [0.0]
    for i, (a, b) in enumerate(zip(got.logprobs, want.logprobs, strict=False)):
        if a.shape != b.shape:
            problems.append(f"prompt {i}'s logprobs are {a.shape}, not {b.shape}")
        elif a.size:
            differences.append(float(np.max(np.abs(a - b))))
    worst = float(np.max(differences))  # NaN when any is
    if not worst <= LOGPROB_TOLERANCE:
        problems.append(f"max |logprob difference| above {LOGPROB_TOLERANCE:g}")
    summary = (
        f"{identical}/{len(want.tokens)} prompts identical over {MAX_TOKENS} tokens, "
        f"max |logprob difference| {worst:.1e} (top {TOP_LOGPROBS})"
    )
    return ("FAIL" if problems else "pass"), "; ".join([summary, *problems])


def _parting(a: list[int], b: list[int]) -> int:
    """The first position where `a` and `b` differ (one may be a prefix of the other)."""
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


def _tokenize(model: Path) -> list[list[int]]:
    # only this process tokenizes: the spawned ranks, which import this module, skip the
    # tokenizer classes (about 0.2 s to import beside the model runner)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [list(tokenizer.encode(p)) for p in PROMPTS]
    if max(map(len, prompts)) + MAX_TOKENS > MAX_MODEL_LEN:
        raise ValueError(f"a prompt and {MAX_TOKENS} tokens exceed {MAX_MODEL_LEN} tokens")
    return prompts


def _decode(
    model: Path, prompts: list[list[int]], tp: int, pp: int, backend: str, expert_parallel: bool
) -> Decoded:
    """The driver rank's `Decoded` from a world of `tp` x `pp` ranks."""
    world = tp * pp
    threads = len(parallel_state.cpu_share(0, world)) if backend == "gloo" else None
    per_rank = run_ranks(
        _rank_decode,
        tp,
        pp,
        str(model),
        prompts,
        expert_parallel,
        backend=backend,
        world=world,
        threads=threads,
        timeout=WORLD_TIMEOUT,
    )
    driver = per_rank[ParallelLayout(tp, pp).driver_rank]
    if not isinstance(driver, Decoded):
        raise RuntimeError(f"the driver rank returned {type(driver).__name__}, not Decoded")
    return driver


def _rank_decode(
    me: Rank, tp: int, pp: int, model: str, prompts: list[list[int]], expert_parallel: bool
) -> object:
    """One rank's share of the steps; the driver returns the `Decoded`, the others None."""
    layout = ParallelLayout(tp, pp, me.rank)
    parallel_state.init_groups(layout, collective_timeout=WORLD_TIMEOUT, device=me.device)
    try:
        return _steps(me, layout, model, prompts, expert_parallel)
    finally:
        parallel_state.destroy_distributed()


def _steps(
    me: Rank, layout: ParallelLayout, model: str, prompts: list[list[int]], expert_parallel: bool
) -> object:

    runner = ModelRunner(
        Path(model),
        dtype="float32",
        quantization="none",
        kv_cache_memory=KV_CACHE_MEMORY,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        device=str(me.device),
        num_threads=torch.get_num_threads(),
        enable_expert_parallel=expert_parallel,
    )
    per_request = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    if runner.num_kv_blocks < per_request * len(prompts):
        raise ValueError(f"{runner.num_kv_blocks} KV blocks hold fewer than {len(prompts)} prompts")
    ids = [str(i) for i in range(len(prompts))]
    blocks = [list(range(i * per_request, (i + 1) * per_request)) for i in range(len(prompts))]
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    step = SchedulerOutput(
        step=0,
        requests=[
            ScheduledRequest(rid, p, 0, b, new=NewRequestData(p, params))
            for rid, p, b in zip(ids, prompts, blocks, strict=True)
        ],
    )
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[np.ndarray]] = [[] for _ in prompts]
    for n in range(MAX_TOKENS):
        output = runner.execute(step)
        if layout.is_driver:
            for r in output.results:
                assert r.token_id is not None and r.logprobs is not None
                tokens[int(r.request_id)].append(r.token_id)
                logprobs[int(r.request_id)].append(r.logprobs.logprobs)
        if n + 1 == MAX_TOKENS:
            break
        # every rank builds the next step from the driver's tokens, as the engine's do
        last = [t[-1] for t in tokens] if layout.is_driver else None
        sampled = object_collectives.broadcast(last, list[int], src=layout.driver_rank)
        step = SchedulerOutput(
            step=n + 1,
            requests=[
                ScheduledRequest(rid, [t], len(p) + n, b)
                for rid, t, p, b in zip(ids, sampled, prompts, blocks, strict=True)
            ],
        )
    if not layout.is_driver:
        return None
    return Decoded(tokens, [np.concatenate(rows) for rows in logprobs])


def _describe(exc: BaseException) -> str:
    """The last line of what failed: each rank's own exception, not the whole traceback."""
    if isinstance(exc, RankError) and exc.tracebacks:
        ranks = sorted(exc.tracebacks.items())
        return "; ".join(f"rank {r}: {text.strip().splitlines()[-1]}" for r, text in ranks)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__
