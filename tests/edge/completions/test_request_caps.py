"""Caps on what one request may ask for: each a 400 naming its field at the edge, and the same
bounds on `SamplingParams` wherever it is made or decoded (an embedder's, the engine core's)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from triode.edge.completions.generation import Prompt as _Prompt
from triode.edge.completions.request_bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
)
from triode.edge.completions.sampling import sampling_params
from triode.edge.completions.serving import Serving
from triode.edge.errors import APIError
from triode.edge.metrics import Metrics
from triode.edge.settings import Settings
from triode.wire import SamplingParams
from triode.wire.messages import MAX_LOGIT_BIAS, MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS

MESSAGES = [{"role": "user", "content": "Hi"}]


def _wire(**fields: Any) -> bytes:
    """SamplingParams as the wire carries them (an array), with `fields` set unchecked."""
    values = msgspec.structs.asdict(SamplingParams()) | fields
    return msgspec.msgpack.encode([values[f] for f in SamplingParams.__struct_fields__])


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = msgspec.json.encode({"messages": MESSAGES, **fields})
    return decode_request(body, ChatCompletionRequest)


def _completion(**fields: Any) -> CompletionRequest:
    return decode_request(msgspec.json.encode({"prompt": "Hi", **fields}), CompletionRequest)


def _refused(make: Any, **fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        sampling_params(make(**fields), prompt_len=4, max_model_len=64)
    assert caught.value.status == 400
    return caught.value


# SamplingParams, wherever it is made


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_LENGTH + 1)]}, "stop"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ],
    ids=["stop strings", "stop length", "logit_bias"],
)
def test_sampling_params_past_a_cap_are_refused_made_or_decoded(
    fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}: at most|^{field}: a stop string"):
        SamplingParams(**fields)
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.msgpack.decode(_wire(**fields), type=SamplingParams)


def test_sampling_params_at_the_caps_are_taken() -> None:
    SamplingParams(
        stop=["x" * MAX_STOP_STRING_LENGTH] * MAX_STOP_STRINGS,
        logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)},
    )


def test_token_id_lists_are_deduplicated_in_order_made_or_decoded() -> None:
    params = SamplingParams(stop_token_ids=[5, 3, 5, 3, 9], allowed_token_ids=[2, 2, 2])
    assert (params.stop_token_ids, params.allowed_token_ids) == ([5, 3, 9], [2])
    wire = _wire(stop_token_ids=[7] * 10_000)
    assert msgspec.msgpack.decode(wire, type=SamplingParams).stop_token_ids == [7]


# The edge: a 400 naming the field


@pytest.mark.parametrize("make", [_chat, _completion])
def test_a_stop_list_past_the_caps_is_a_400_naming_stop(make: Any) -> None:
    assert _refused(make, stop=["x"] * (MAX_STOP_STRINGS + 1)).param == "stop"
    assert _refused(make, stop="x" * (MAX_STOP_STRING_LENGTH + 1)).param == "stop"


def test_logit_bias_of_301_is_a_400_before_its_keys_are_read() -> None:
    error = _refused(_chat, logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)})
    assert error.param == "logit_bias" and "at most 300" in error.message
    # keys that are not even token ids: refused for the count, not read one by one
    big = {f"k{i}": 1 for i in range(100_000)}
    assert "at most 300" in _refused(_chat, logit_bias=big).message


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
def test_a_token_id_list_longer_than_any_vocabulary_is_a_400_at_decode(field: str) -> None:
    with pytest.raises(APIError) as caught:
        _completion(**{field: [1] * ((1 << 18) + 1)})
    assert caught.value.param == field


def _serving(**settings: Any) -> Serving:
    engine = SimpleNamespace(dead=None, max_model_len=64, vocab_size=100, generation_defaults={})
    return Serving(engine, Settings(served_model_names=["m"], **settings), Metrics("m"))  # type: ignore[arg-type]


def test_prompts_times_n_past_the_cap_is_a_400_naming_n_or_prompt() -> None:
    serving = _serving(max_choices_per_request=8)
    serving.check_choices(_completion(n=2), 4)
    with pytest.raises(APIError) as caught:
        serving.check_choices(_completion(n=3), 3)
    assert caught.value.param == "n"
    with pytest.raises(APIError) as caught:
        serving.check_choices(_completion(), 9)
    assert caught.value.param == "prompt"
    with pytest.raises(APIError) as caught:
        serving.check_choices(_chat(n=9), 1)
    assert caught.value.param == "n"


def _volume(serving: Serving, req: Any, prompts: int = 1, prompt_len: int = 4) -> None:
    params = sampling_params(req, prompt_len=prompt_len, max_model_len=64)
    serving.check_logprobs_volume(req, [_Prompt([1] * prompt_len, None)] * prompts, params)


def test_the_logprobs_of_a_whole_answer_are_capped_and_a_stream_is_not() -> None:
    # (1 + 4 alternatives) x 10 tokens x n = 2: 100 entries
    serving = _serving(max_logprob_entries=100)
    _volume(serving, _chat(logprobs=True, top_logprobs=4, max_tokens=10, n=2))
    with pytest.raises(APIError) as caught:
        _volume(serving, _chat(logprobs=True, top_logprobs=4, max_tokens=10, n=3))
    assert caught.value.param == "top_logprobs"
    _volume(serving, _chat(logprobs=True, top_logprobs=4, max_tokens=10, n=3, stream=True))
    with pytest.raises(APIError) as caught:
        _volume(serving, _completion(logprobs=4, max_tokens=10), prompts=3)
    assert caught.value.param == "logprobs"
    with pytest.raises(APIError) as caught:  # prompt logprobs: (1 + 5) x 20 positions
        _volume(serving, _completion(prompt_logprobs=5, max_tokens=1), prompt_len=20)
    assert caught.value.param == "prompt_logprobs"


def test_no_logprobs_asked_for_costs_nothing_against_the_cap() -> None:
    _volume(_serving(max_logprob_entries=1), _chat(max_tokens=60, n=128))
