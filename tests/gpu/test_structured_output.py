"""Structured output end to end in one process: a scheduler with the grammar manager and a
runner on a tiny random-weight model (its tokenizer is the default model's when fetched, so the
vocabulary is real). Random weights make the unconstrained output noise, so an output that
parses and validates every time is the grammar's doing."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import trio

from triode.actors.config import EngineArgs
from triode.actors.core.executor import InProcessExecutor
from triode.actors.core.model_thread import ModelThread
from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.actors.core.structured_output import StructuredOutputManager
from triode.actors.grammar import check_grammar, grammar_of
from triode.gpu.logits_processing import apply_token_bitmask
from triode.gpu.model_runner import ModelRunner
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import EngineCoreOutput, EngineCoreRequest, SamplingParams
from triode.wire import StructuredOutputsParams as SO

PROMPT = [(5 * i + 11) % 200 + 1 for i in range(20)]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Scheduler, ModelRunner]:
    model = build_tiny_model(tmp_path_factory.mktemp("so") / "tiny")
    runner = ModelRunner(
        model, dtype="float32", kv_cache_memory=2 << 20, max_model_len=512, num_threads=1
    )
    eos = [runner.eos_token_id] if runner.eos_token_id is not None else []
    manager = StructuredOutputManager(model / "tokenizer.json", runner.vocab_size, eos)
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=runner.num_kv_blocks, block_size=runner.block_size, max_model_len=512
        ),
        structured=manager,
    )
    return scheduler, runner


def _run(
    engine: tuple[Scheduler, ModelRunner], requests: dict[str, SamplingParams]
) -> dict[str, list[EngineCoreOutput]]:
    scheduler, runner = engine
    manager = scheduler.structured
    assert manager is not None
    for request_id, params in requests.items():
        so = params.structured_outputs
        grammar = manager.compile_now(so) if so is not None else None
        request = EngineCoreRequest(request_id, PROMPT, params, eos_token_id=runner.eos_token_id)
        assert scheduler.add_request(request, grammar) is None
    outputs: dict[str, list[EngineCoreOutput]] = {r: [] for r in requests}
    with ThreadPoolExecutor(1) as fills:  # the bitmask is filled beside the forward
        for _ in range(2000):
            if not scheduler.has_unfinished_requests():
                break
            sched = scheduler.schedule()
            result = runner.execute(sched, fills.submit(scheduler.fill_bitmask, sched).result)
            for per_client in scheduler.update_from_output(sched, result).values():
                for o in per_client.outputs:
                    outputs[o.request_id].append(o)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.usage == 0
    return outputs


def _text(engine: tuple[Scheduler, ModelRunner], outputs: list[EngineCoreOutput]) -> str:
    from tokenizers import Tokenizer

    scheduler, _ = engine
    assert scheduler.structured is not None
    tokenizer = Tokenizer.from_file(str(scheduler.structured.tokenizer_file))
    ids = [t for o in outputs for t in o.new_token_ids]
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_json_schema_output_validates_on_many_seeds_in_one_batch(engine) -> None:
    so = SO(json=json.dumps(SCHEMA))
    requests = {
        f"r{seed}": SamplingParams(
            temperature=1.0, seed=seed, max_tokens=200, structured_outputs=so
        )
        for seed in range(12)
    }
    requests["free"] = SamplingParams(temperature=1.0, seed=1, max_tokens=8)  # beside them
    outputs = _run(engine, requests)
    for request_id in requests:
        if request_id == "free":
            continue
        last = outputs[request_id][-1]
        assert str(last.finish_reason) == "stop", (request_id, last)
        value = json.loads(_text(engine, outputs[request_id]))
        jsonschema.validate(value, SCHEMA)
    assert sum(len(o.new_token_ids) for o in outputs["free"]) == 8
    manager = engine[0].structured
    assert manager is not None and manager.cache_hits >= 11  # one compile, copies after it


@pytest.mark.parametrize(
    ("so", "check"),
    [
        (SO(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (SO(choice=["alpha", "beta gamma"]), lambda t: t in ("alpha", "beta gamma")),
        (SO(grammar='root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),
        (SO(grammar='start: "x" NUM\nNUM: /[1-9]/'), lambda t: re.fullmatch("x[1-9]", t)),
    ],
    ids=["regex", "choice", "gbnf", "lark"],
)
def test_each_kind_of_constraint_holds_greedy_and_sampled(engine, so: SO, check) -> None:
    requests = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so),
        "sampled": SamplingParams(temperature=1.5, seed=7, max_tokens=120, structured_outputs=so),
    }
    outputs = _run(engine, requests)
    for request_id in requests:
        text = _text(engine, outputs[request_id])
        assert str(outputs[request_id][-1].finish_reason) == "stop", (request_id, text)
        assert check(text), (request_id, text)


def test_json_object_output_is_a_json_object_so_far(engine) -> None:
    # Random weights wander inside strings, so the object may not close within max_tokens;
    # what it produced must still be a JSON object's prefix.
    so = SO(json_object=True)
    outputs = _run(
        engine, {"o": SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)}
    )
    text = _text(engine, outputs["o"])
    assert text.startswith("{")
    if str(outputs["o"][-1].finish_reason) == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_request_whose_grammar_did_not_come_along_is_refused(engine) -> None:
    scheduler, _ = engine
    params = SamplingParams(structured_outputs=SO(regex="a+"))
    rejected = scheduler.add_request(EngineCoreRequest("lone", PROMPT, params))
    assert rejected is not None and str(rejected.finish_reason) == "error"
    assert "structured_outputs" in str(rejected.stop_reason)


@pytest.mark.parametrize(
    ("so", "field"),
    [
        (SO(json='{"type": "foo"}'), "json"),
        (SO(json="{not json"), "json"),
        (SO(json='{"$ref": "#/nowhere"}'), "json"),
        (SO(regex="(unclosed"), "regex"),
        (SO(grammar="start: undefined_rule"), "grammar"),
        (SO(grammar="root ::= ("), "grammar"),
    ],
)
def test_bad_constraints_are_named_errors(so: SO, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        check_grammar(so)


def test_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])
    assert grammar_of(SO(choice=['say "hi"']))


def test_a_constrained_step_without_its_bitmask_is_refused(engine) -> None:
    scheduler, runner = engine
    assert scheduler.structured is not None
    params = SamplingParams(max_tokens=2, structured_outputs=SO(regex="a+"))
    grammar = scheduler.structured.compile_now(params.structured_outputs)
    request = EngineCoreRequest("unmasked", PROMPT, params, eos_token_id=runner.eos_token_id)
    assert scheduler.add_request(request, grammar) is None
    sched = scheduler.schedule()
    assert sched.grammar_request_ids == ["unmasked"] and sched.grammar_bitmask is None
    with pytest.raises(ValueError, match="without its bitmask"):
        runner.execute(sched)
    scheduler.abort_requests(["unmasked"])
    assert scheduler.kv_cache.usage == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["fill-first", "fill-beside-forward"])
def test_the_in_process_executor_masks_every_sampled_token(
    engine, tmp_path: Path, overlap: bool
) -> None:
    scheduler, _ = engine
    assert scheduler.structured is not None
    model = build_tiny_model(tmp_path / "tiny")
    args = EngineArgs(model=str(model), dtype="float32", kv_cache_memory=2 << 20)
    thread = ModelThread()
    executor = InProcessExecutor(args, thread)
    executor._overlap_bitmask = overlap  # on CPU it fills first; an accelerator overlaps
    so = SO(regex="[a-c]{6}")
    outputs: list[EngineCoreOutput] = []

    async def run() -> None:
        for seed in range(4):
            params = SamplingParams(
                temperature=1.0, seed=seed, max_tokens=12, structured_outputs=so
            )
            request = EngineCoreRequest(
                f"x{seed}", PROMPT, params, eos_token_id=executor.eos_token_id
            )
            grammar = scheduler.structured.compile_now(so)  # type: ignore[union-attr]
            assert scheduler.add_request(request, grammar) is None
        while scheduler.has_unfinished_requests():
            sched = scheduler.schedule()
            result = await executor.execute(sched, scheduler.fill_bitmask)
            for per_client in scheduler.update_from_output(sched, result).values():
                outputs.extend(per_client.outputs)

    try:
        trio.run(run)
    finally:
        executor.shutdown()
        thread.close()
    for seed in range(4):
        mine = [o for o in outputs if o.request_id == f"x{seed}"]
        assert re.fullmatch("[a-c]{6}", _text(engine, mine)), _text(engine, mine)
        assert str(mine[-1].finish_reason) == "stop"
    assert scheduler.kv_cache.usage == 0


def test_a_mask_over_every_row_keeps_each_word_s_top_bit() -> None:
    logits = torch.zeros(2, 64)
    mask = np.zeros((2, 2), dtype=np.int32)
    mask[0, 0] = np.int32(-(1 << 31))  # token 31: the sign bit
    mask[1, 1] = 1 | np.int32(-(1 << 31))  # tokens 32 and 63
    apply_token_bitmask(logits, [0, 1], mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [32, 63]


def test_bitmask_rows_apply_to_their_logits_only() -> None:
    logits = torch.zeros(3, 40)
    mask = np.zeros((2, 2), dtype=np.int32)
    mask[0, 0] = 1 << 3  # token 3
    mask[1, 1] = 1 << 4  # token 36
    apply_token_bitmask(logits, [2, 0], mask)
    assert torch.isinf(logits[2]).sum() == 39 and logits[2, 3] == 0
    assert torch.isinf(logits[0]).sum() == 39 and logits[0, 36] == 0
    assert not torch.isinf(logits[1]).any()


def test_a_grammar_built_for_one_request_serves_those_that_ask_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a request aborted while its grammar builds, and the next with the same schema: one build
    model = build_tiny_model(tmp_path / "tiny")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    manager = StructuredOutputManager(model / "tokenizer.json", vocab, [])
    started, release = threading.Event(), threading.Event()
    tokenizer = manager._llg_tokenizer

    def slow_build_starts() -> object:  # what only a build asks for
        started.set()
        assert release.wait(10)
        return tokenizer()

    monkeypatch.setattr(manager, "_llg_tokenizer", slow_build_starts)
    params = SO(json=json.dumps(SCHEMA))
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(manager.compile_now, params)
        assert started.wait(10)
        others = [pool.submit(manager.compile_now, params) for _ in range(2)]
        release.set()
        grammars = [f.result(10) for f in (first, *others)]
    assert manager.compiled == 1 and manager.cache_hits == 2
    assert len({id(g) for g in grammars}) == 3  # each request its own matcher
    with pytest.raises(ValueError, match="json"):  # a failed build fails its waiters too
        manager.compile_now(SO(json='{"type": "nothing"}'))
