"""What a LoRA adapter does to the prefix cache and to KV-transfer seals: blocks are shared only
under the same adapter content (a reload with new weights under the same name shares nothing
with the old), and params sealed for one adapter's prompt are made for another prompt under any
other adapter."""

from __future__ import annotations

from triode.actors.core.loras import LoRAEntry
from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.wire import EngineCoreRequest, SamplingParams
from triode.wire.kv_seal import kv_salt, prompt_digest, seal, verify

PROMPT = list(range(1, 42))  # ten full blocks of 4, and one token more
SECRET = b"s" * 32


def _entry(name: str, lora_id: int, digest: str) -> LoRAEntry:
    entry = LoRAEntry(name, f"/adapters/{name}", f"/adapters/{name}", lora_id, None)
    entry.digest = digest
    return entry


def _cached_tokens(
    scheduler: Scheduler, request_id: str, lora: LoRAEntry | None, salt: str | None = None
) -> int:
    """Start a request for PROMPT and return its prefix-cache hit; then abort it (its blocks
    stay cached, free)."""
    request = EngineCoreRequest(
        request_id,
        PROMPT,
        SamplingParams(max_tokens=4),
        lora_name=None if lora is None else lora.name,
        cache_salt=salt,
    )
    assert scheduler.add_request(request, lora=lora) is None
    out = scheduler.schedule()
    assert [r.request_id for r in out.requests] == [request_id]
    hit = scheduler.requests[request_id].num_cached_tokens
    scheduler.abort_requests([request_id])
    return hit


def test_lora_prefix_blocks_are_shared_only_under_the_same_adapter_content() -> None:
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=256)
    scheduler = Scheduler(config)
    a = _entry("a", 1, "aa" * 32)
    b = _entry("b", 2, "bb" * 32)
    a_reloaded = _entry("a", 3, "cc" * 32)  # the same name, new weights
    full = (len(PROMPT) - 1) // 4 * 4

    assert _cached_tokens(scheduler, "base-1", None) == 0
    assert _cached_tokens(scheduler, "a-1", a) == 0
    assert _cached_tokens(scheduler, "b-1", b) == 0
    assert _cached_tokens(scheduler, "a2-1", a_reloaded) == 0
    assert _cached_tokens(scheduler, "a-salted", a, salt="tenant") == 0
    # each hits its own, and only its own
    assert _cached_tokens(scheduler, "base-2", None) == full
    assert _cached_tokens(scheduler, "a-2", a) == full
    assert _cached_tokens(scheduler, "b-2", b) == full
    assert _cached_tokens(scheduler, "a2-2", a_reloaded) == full
    assert _cached_tokens(scheduler, "a-salted-2", a, salt="tenant") == full
    # the adapter's entry was held by each request until it left
    assert a.users == b.users == a_reloaded.users == 0


def test_lora_requests_tell_the_runner_their_adapter_id() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=256))
    a = _entry("a", 7, "aa" * 32)
    assert scheduler.add_request(EngineCoreRequest("r", PROMPT, SamplingParams()), lora=a) is None
    assert scheduler.add_request(EngineCoreRequest("base", PROMPT, SamplingParams())) is None
    out = scheduler.schedule()
    new = {r.request_id: r.new for r in out.requests}
    assert new["r"] is not None and new["r"].lora_id == 7
    assert new["base"] is not None and new["base"].lora_id == 0
    assert a.users == 1
    scheduler.abort_requests(["r", "base"])
    assert a.users == 0


def test_lora_seals_bind_the_adapter() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "p"}
    made_for_a = seal(SECRET, params, prompt_digest(PROMPT, kv_salt(None, "a")), ttl=60)
    assert verify(SECRET, made_for_a, prompt_digest(PROMPT, kv_salt(None, "a"))) is None
    for other in (kv_salt(None, "b"), kv_salt(None, None), kv_salt("a", None)):
        assert verify(SECRET, made_for_a, prompt_digest(PROMPT, other)) == (
            "kv_transfer_params: made for another prompt"
        )
    # a base-model request's digest is what it was before adapters existed
    assert kv_salt("s", None) == "s" and kv_salt(None, None) is None
    salted = seal(SECRET, params, prompt_digest(PROMPT, kv_salt("s", "a")), ttl=60)
    assert verify(SECRET, salted, prompt_digest(PROMPT, kv_salt("s", "b"))) is not None
    assert verify(SECRET, salted, prompt_digest(PROMPT, kv_salt("s", "a"))) is None
