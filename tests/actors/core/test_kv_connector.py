"""The KV connector's scheduler side under hostile params: seals, prompt digests, holds and
their cap, and what may enter the prefix cache after a load. A scheduler with a connector and
no model: each step samples a constant token, and the workers' transfer reports are made here.
"""

from __future__ import annotations

from typing import Any

import pytest

from triode.actors.core.kv_connector import KVConnectorScheduler
from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.actors.kv_params import seal_error, transfer_params_error
from triode.wire import EngineCoreOutput, EngineCoreRequest, SamplingParams
from triode.wire.kv_seal import prompt_digest, seal, seal_remote_decode, verify
from triode.wire.kv_transfer import KVConnectorOutput, KVTransferConfig
from triode.wire.step import ModelRunnerOutput, RequestStepResult

SECRET = b"0123456789abcdef" * 4
NOW = 1_800_000_000.0
BLOCK = 4
PROMPT_A = [11, 12, 13, 14, 15, 16, 17, 18, 19]  # 3 blocks, the last partial
PROMPT_B = [21, 22, 23, 24, 25, 26, 27, 28, 29]


class Instance:
    """One engine core's scheduler and connector, stepped by hand."""

    def __init__(self, role: str, num_blocks: int = 32, **extra: Any) -> None:
        self.now = NOW
        config = KVTransferConfig(
            kv_connector="TriodeConnector",
            kv_role=role,
            engine_id=role,
            kv_connector_extra_config={"secret_file": "unread", **extra},
        )
        self.connector = KVConnectorScheduler(
            config,
            block_size=BLOCK,
            endpoints=["tcp://127.0.0.1:5555"],
            secret=SECRET,
            wall_clock=lambda: self.now,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK, max_model_len=64),
            self.connector,
        )
        self.outputs: dict[str, list[EngineCoreOutput]] = {}

    def add(
        self, request_id: str, prompt: list[int], params: dict[str, Any] | None, max_tokens=1
    ) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = EngineCoreRequest(request_id, prompt, sampling, kv_transfer_params=params)
        assert self.scheduler.add_request(request) is None

    def step(self, report: KVConnectorOutput | None = None) -> None:
        out = self.scheduler.schedule()
        results = [RequestStepResult(r.request_id, token_id=7) for r in out.requests if r.sample]
        runner_output = ModelRunnerOutput(out.step, results, kv_connector_output=report)
        for outputs in self.scheduler.update_from_output(out, runner_output).values():
            for o in outputs.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)

    def run(self, request_id: str) -> dict[str, Any] | None:
        """Step until `request_id` finishes; the params it handed on."""
        for _ in range(100):
            finished = [o for o in self.outputs.get(request_id, []) if o.finish_reason is not None]
            if finished:
                return finished[0].kv_transfer_params
            self.step()
        raise AssertionError(f"{request_id} did not finish")

    @property
    def held_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.scheduler.held.values())


def _ask() -> dict[str, Any]:
    """A do_remote_decode request as the deployment's proxy seals it."""
    return seal_remote_decode(SECRET, {"do_remote_decode": True}, now=NOW)


def _prefill_params(request_id: str, prompt: list[int]) -> dict[str, Any]:
    """What a prefill of `prompt` hands on, sealed for it."""
    producer = Instance("kv_producer")
    producer.add(request_id, prompt, _ask())
    params = producer.run(request_id)
    assert params is not None and params["do_remote_prefill"] is True
    return params


def test_a_prefill_holds_blocks_only_for_a_request_the_proxy_sealed() -> None:
    producer = Instance("kv_producer")
    other = seal_remote_decode(b"another deployment's secret.....", {"do_remote_decode": True})
    for request_id, params in (("plain", {"do_remote_decode": True}), ("other", other)):
        producer.add(request_id, PROMPT_A, params)
        assert producer.run(request_id) == {
            "do_remote_prefill": False,
            "do_remote_decode": False,
            "hold": False,
        }
    assert not producer.scheduler.held and producer.scheduler.kv_cache.usage == 0
    assert producer.scheduler.get_stats().kv_params_refused == 2
    sealed = _ask()
    producer.add("sealed", PROMPT_A, sealed)
    params = producer.run("sealed")
    assert params is not None and list(producer.scheduler.held) == ["sealed"]
    assert verify(SECRET, params, prompt_digest(PROMPT_A), now=NOW) is None
    assert verify(SECRET, params, prompt_digest(PROMPT_B), now=NOW) is not None


def test_a_proxy_seal_past_its_expiry_holds_nothing() -> None:
    producer = Instance("kv_producer")
    stale = seal_remote_decode(SECRET, {"do_remote_decode": True}, now=NOW - 3600)
    producer.add("stale", PROMPT_A, stale)
    assert producer.run("stale") == {
        "do_remote_prefill": False,
        "do_remote_decode": False,
        "hold": False,
    }
    assert not producer.scheduler.held


def test_a_proxy_seal_holds_blocks_once_and_a_replay_of_it_holds_nothing() -> None:
    producer = Instance("kv_producer")
    sealed = _ask()
    producer.add("first", PROMPT_A, sealed)
    assert producer.run("first") is not None and list(producer.scheduler.held) == ["first"]
    producer.add("replayed", PROMPT_A, dict(sealed))
    assert producer.run("replayed") == {
        "do_remote_prefill": False,
        "do_remote_decode": False,
        "hold": False,
    }
    assert list(producer.scheduler.held) == ["first"]
    assert producer.scheduler.get_stats().kv_params_refused == 1
    # a nonce is forgotten once its seal has expired, which refuses it anyway
    producer.now = sealed["expires_at"] + 1
    producer.add("late", PROMPT_A, dict(sealed))
    producer.run("late")
    assert not producer.connector._nonces


def test_a_hold_keeps_the_prompts_blocks_only() -> None:
    producer = Instance("kv_producer")
    producer.add("long", PROMPT_A, _ask(), 12)
    params = producer.run("long")  # 9 + 12 tokens: 6 blocks written, 3 of them the prompt's
    assert params is not None and len(params["remote_block_ids"]) == 3
    assert producer.held_blocks == 3
    assert producer.scheduler.kv_cache.num_free_blocks == 32 - 3


def test_holds_past_max_hold_fraction_answer_without_one_and_free_their_blocks() -> None:
    producer = Instance("kv_producer", num_blocks=16, max_hold_fraction=0.5)  # 8 blocks
    for i in range(3):
        producer.add(f"r{i}", PROMPT_A, _ask())
    assert [producer.run(f"r{i}")["do_remote_prefill"] for i in range(3)] == [True, True, False]
    assert producer.held_blocks == 6 and producer.connector.num_held_blocks == 6
    assert producer.run("r2") == {"do_remote_prefill": False, "do_remote_decode": False,
                                  "hold": False}  # fmt: skip
    # a hold given back makes room again
    producer.scheduler.abort_requests(["r0"])
    producer.add("r3", PROMPT_A, _ask())
    assert producer.run("r3")["do_remote_prefill"] is True
    assert producer.connector.num_held_blocks == 6


def _forgeries(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    unsealed = {k: v for k, v in params.items() if k != "seal"}
    return {
        "unsealed": unsealed,
        "altered blocks": {
            **params,
            "remote_block_ids": [b + 1 for b in params["remote_block_ids"]],
        },
        "other deployment": seal(
            b"another deployment's secret.....", unsealed, params["prompt_digest"], ttl=60, now=NOW
        ),
        "huge integer": {**params, "remote_num_tokens": 2**80},
    }


@pytest.mark.parametrize("case", ["another prompt", "unsealed", "altered blocks",
                                  "other deployment", "huge integer", "expired"])  # fmt: skip
def test_a_decode_loads_nothing_for_params_not_sealed_for_its_prompt(case: str) -> None:
    params = _prefill_params("p", PROMPT_A)
    consumer = Instance("kv_consumer")
    prompt = PROMPT_A
    if case == "another prompt":  # the live attack: A's params with prompt B
        prompt = PROMPT_B
    elif case == "expired":
        consumer.now = NOW + 3600
    else:
        params = _forgeries(params)[case]
    consumer.add("d", prompt, params, max_tokens=2)
    consumer.step()
    assert not consumer.scheduler.loading and not consumer.connector.loading
    assert consumer.connector.seal_refusals == 1
    assert consumer.scheduler.get_stats().kv_params_refused == 1
    consumer.run("d")  # computed here, from its own prompt
    assert consumer.scheduler.prompt_tokens_transferred == 0
    assert consumer.scheduler.prompt_tokens_computed == len(prompt)


def _start_load(consumer: Instance) -> None:
    consumer.add("d", PROMPT_A, _prefill_params("p", PROMPT_A), max_tokens=2)
    consumer.step()
    assert "d" in consumer.scheduler.loading


def test_a_verified_load_fills_the_prefix_cache_after_it_is_through() -> None:
    consumer = Instance("kv_consumer")
    _start_load(consumer)
    assert not consumer.scheduler.kv_cache.pool.cached  # nothing while the blocks load
    consumer.step(KVConnectorOutput(finished_recving=["d"]))
    assert len(consumer.scheduler.kv_cache.pool.cached) == 2  # the prompt's full blocks


def test_a_failed_load_leaves_the_prefix_cache_alone() -> None:
    consumer = Instance("kv_consumer")
    _start_load(consumer)
    consumer.step(KVConnectorOutput(failed_recving=["d"]))
    assert not consumer.scheduler.kv_cache.pool.cached
    assert consumer.scheduler.kv_load_failures == 1


def test_a_load_the_connector_did_not_plan_never_fills_the_prefix_cache() -> None:
    consumer = Instance("kv_consumer")
    _start_load(consumer)
    consumer.connector.loading.discard("d")  # its params never verified, say
    consumer.step(KVConnectorOutput(finished_recving=["d"]))
    assert not consumer.scheduler.kv_cache.pool.cached
    assert consumer.scheduler.kv_load_failures == 1


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": False, "x": 2**64},  # msgpack has no room for it: it was a 500
        {"x": -(2**63) - 1},
        {"x": [2**70]},
        {"x": {"nested": 1}},
        {"x": 1.5},
        {"x": "a" * 10_000},
        {"x": list(range(200_000))},
        {f"k{i}": 0 for i in range(100)},
    ],
)
def test_params_no_wire_message_can_carry_are_refused_by_shape(params: dict[str, Any]) -> None:
    problem = transfer_params_error(params)
    assert problem is not None and problem.startswith("kv_transfer_params: ")


def test_params_that_say_no_hold_need_no_seal_and_load_nothing() -> None:
    """What a prefill past its hold cap answers goes through the proxy to the decode, which
    computes the prompt."""
    no_hold = {"do_remote_prefill": False, "do_remote_decode": False, "hold": False}
    assert seal_error(SECRET, no_hold, PROMPT_A) is None
    consumer = Instance("kv_consumer")
    consumer.add("d", PROMPT_A, no_hold, max_tokens=2)
    consumer.run("d")
    assert consumer.connector.seal_refusals == 0 and not consumer.scheduler.loading
