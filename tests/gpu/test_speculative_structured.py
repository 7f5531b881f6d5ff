"""Speculative decoding of constrained requests, end to end in one process: a scheduler with
the grammar manager and a drafter, a runner on a tiny random-weight model. Proposals come
from the answer decoding without speculation gave, some spoiled (with a token the grammar
refuses there, for greedy requests); the answer with them must be that answer, the grammar
must cut the proposals it refuses and mask every verified position, and a sampled answer must
validate."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.actors.core.speculation.config import SpeculativeConfig
from triode.actors.core.speculation.drafter import Drafter
from triode.actors.core.structured_output import StructuredOutputManager
from triode.gpu.model_runner import ModelRunner
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import EngineCoreRequest, SamplingParams
from triode.wire import StructuredOutputsParams as SO

PROMPT = [(5 * i + 11) % 200 + 1 for i in range(20)]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 4},
    },
    "required": ["color", "count", "tags"],
    "additionalProperties": False,
}


class Answers:
    """Proposes the rest of a known answer, every third proposal spoiled with `spoil`."""

    def __init__(self, answers: dict[str, list[int]], spoil: int) -> None:
        self.answers, self.spoil = answers, spoil
        self.done: dict[str, int] = {}
        self.proposed = 0

    def start(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.done[request_id] = 0

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.done[request_id] += len(token_ids)

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        n = self.done[request_id]
        out = list(self.answers[request_id][n : n + max_tokens])
        for i in range(len(out)):
            if (n + i) % 3 == 2:
                out[i] = self.spoil
        self.proposed += len(out)
        return out

    def stop(self, request_id: str) -> None:
        self.done.pop(request_id, None)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("spec-so") / "tiny")


def _decode(model: Path, requests: dict[str, SamplingParams], drafter: Drafter | None):
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
        drafter=drafter,
    )
    for request_id, params in requests.items():
        grammar = manager.compile_now(params.structured_outputs)
        request = EngineCoreRequest(request_id, PROMPT, params, eos_token_id=runner.eos_token_id)
        assert scheduler.add_request(request, grammar) is None
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    verified = 0
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        sched = scheduler.schedule()
        scheduler.fill_bitmask(sched)
        verified += sum(r.num_draft_tokens for r in sched.requests)
        for per_client in scheduler.update_from_output(sched, runner.execute(sched)).values():
            for o in per_client.outputs:
                tokens[o.request_id] += o.new_token_ids
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.usage == 0
    return tokens, verified, manager


def test_constrained_greedy_answers_with_proposals_are_those_without(model: Path) -> None:
    so = SO(json=json.dumps(SCHEMA))
    requests = {
        f"g{i}": SamplingParams(
            temperature=0.0, max_tokens=60, structured_outputs=so, logit_bias={200 + i: 5.0}
        )
        for i in range(3)
    }
    plain, _, manager = _decode(model, requests, None)
    tokenizer = Tokenizer.from_file(str(manager.tokenizer_file))
    for answer in plain.values():
        jsonschema.validate(json.loads(tokenizer.decode(answer, skip_special_tokens=True)), SCHEMA)
    brace = tokenizer.token_to_id("{")  # never allowed past the answer's first token
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    answers = Answers(plain, spoil=brace)
    drafter = Drafter(config, answers, slope=0.0)
    spec, verified, _ = _decode(model, requests, drafter)
    assert spec == plain
    assert verified > 0 and drafter.num_accepted_tokens > 0
    # the grammar cut the proposals at every "{": only what it allows was verified
    assert verified < answers.proposed


def test_constrained_sampled_answers_with_proposals_validate(model: Path) -> None:
    so = SO(json=json.dumps(SCHEMA))
    requests = {
        f"s{i}": SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=so)
        for i in range(4)
    }
    plain, _, manager = _decode(model, requests, None)
    tokenizer = Tokenizer.from_file(str(manager.tokenizer_file))
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    drafter = Drafter(config, Answers(plain, spoil=0), slope=0.0)
    spec, verified, _ = _decode(model, requests, drafter)
    assert verified > 0
    for answer in spec.values():
        jsonschema.validate(json.loads(tokenizer.decode(answer, skip_special_tokens=True)), SCHEMA)
