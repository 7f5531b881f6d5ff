"""`prompt_embeds` in `/v1/completions`: what decodes, and every hostile payload a 400 naming
the field, none of which runs code."""

from __future__ import annotations

import base64
import io
import os
import pickle
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from triode.edge.completions.prompt_embeds import decode_prompt_embeds
from triode.edge.completions.request_bodies import CompletionRequest, decode_request
from triode.edge.completions.serving import Serving
from triode.edge.errors import APIError
from triode.edge.http import Request
from triode.edge.metrics import Metrics
from triode.edge.settings import Settings

HIDDEN = 8
MAX_MODEL_LEN = 64
LIMIT = 1 << 20


def _saved(obj: Any, **options: Any) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **options)
    return base64.b64encode(buffer.getvalue()).decode()


def _decode(payload: str) -> torch.Tensor:
    return decode_prompt_embeds(
        payload, hidden_size=HIDDEN, max_model_len=MAX_MODEL_LEN, max_bytes=LIMIT
    )


def _refused(payload: str) -> APIError:
    with pytest.raises(APIError) as caught:
        _decode(payload)
    assert caught.value.status == 400
    assert caught.value.param == "prompt_embeds"
    assert caught.value.message.startswith("prompt_embeds: ")
    return caught.value


class _RunsACommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_saved_tensor_decodes_to_itself(dtype: torch.dtype) -> None:
    tensor = torch.randn(5, HIDDEN).to(dtype)

    decoded = _decode(_saved(tensor))

    assert decoded.dtype == dtype and torch.equal(decoded, tensor)


def test_a_batch_of_one_is_taken_as_its_one_prompt() -> None:
    tensor = torch.randn(1, 3, HIDDEN)

    assert torch.equal(_decode(_saved(tensor)), tensor[0])


def test_a_parameter_and_a_non_contiguous_view_decode_as_plain_tensors() -> None:
    base = torch.randn(HIDDEN, 4)

    assert torch.equal(_decode(_saved(torch.nn.Parameter(base.T.clone()))), base.T)
    decoded = _decode(_saved(base.T))
    assert type(decoded) is torch.Tensor and decoded.is_contiguous()
    assert torch.equal(decoded, base.T)


@pytest.mark.parametrize("payload", ["not base64!", "YWJj=", "é", ""])
def test_what_is_not_base64_is_refused(payload: str) -> None:
    _refused(payload)


def test_a_pickle_that_runs_a_command_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    exploit = _RunsACommand(f"touch {marker}")

    _refused(base64.b64encode(pickle.dumps(exploit)).decode())  # a bare pickle
    message = _refused(_saved(exploit)).message  # in torch.save's archive, past the zip check
    _refused(_saved(exploit, _use_new_zipfile_serialization=False))

    assert not marker.exists()
    assert "not a torch.save'd tensor" in message


@pytest.mark.parametrize(
    ("obj", "why"),
    [
        ([1.0, 2.0], "must be a tensor"),
        ({"embeds": torch.zeros(2, HIDDEN)}, "must be a tensor"),
        ((torch.zeros(2, HIDDEN),), "must be a tensor"),
        ("text", "must be a tensor"),
        (torch.zeros(HIDDEN), "must be [positions, hidden size]"),
        (torch.zeros(2, 2, HIDDEN), "must be [positions, hidden size]"),
        (torch.zeros(1, 1, 2, HIDDEN), "must be [positions, hidden size]"),
        (torch.zeros(3, HIDDEN + 1), "hidden size is 8"),
        (torch.zeros(3, HIDDEN, dtype=torch.float64), "dtype must be"),
        (torch.zeros(3, HIDDEN, dtype=torch.int64), "dtype must be"),
        (torch.zeros(0, HIDDEN), "at least one position"),
        (torch.zeros(MAX_MODEL_LEN, HIDDEN), "maximum context length"),
        (torch.tensor([[float("nan")] * HIDDEN]), "not finite"),
        (torch.tensor([[0.0] * (HIDDEN - 1) + [float("-inf")]]).bfloat16(), "not finite"),
        (torch.zeros(2, HIDDEN).to_sparse(), ""),
    ],
    ids=repr,
)
def test_what_is_not_one_prompt_of_embeddings_is_refused(obj: Any, why: str) -> None:
    assert why in _refused(_saved(obj)).message


def test_a_compressed_archive_is_refused_before_it_inflates() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data/0", bytes(64 << 20))  # 64 MiB of zeros in ~64 KiB

    payload = base64.b64encode(buffer.getvalue()).decode()

    assert len(payload) < LIMIT
    assert "stored, not compressed" in _refused(payload).message


def test_an_archive_larger_than_the_body_limit_is_refused() -> None:
    payload = _saved(torch.zeros(4, HIDDEN))
    with pytest.raises(APIError) as caught:
        decode_prompt_embeds(payload, hidden_size=HIDDEN, max_model_len=64, max_bytes=100)
    assert caught.value.param == "prompt_embeds" and "more than 100 bytes" in str(caught.value)


def test_a_truncated_archive_is_refused() -> None:
    raw = base64.b64decode(_saved(torch.zeros(4, HIDDEN)))

    _refused(base64.b64encode(raw[: len(raw) // 2]).decode())


# The request body


def _body(**fields: Any) -> bytes:
    return msgspec.json.encode({"model": "m", "max_tokens": 4, **fields})


def test_prompt_embeds_alone_or_with_an_empty_prompt_are_prompts_of_their_own() -> None:
    payload = _saved(torch.zeros(2, HIDDEN))
    for fields in ({}, {"prompt": None}, {"prompt": ""}, {"prompt": []}):
        req = decode_request(_body(prompt_embeds=payload, **fields), CompletionRequest)
        assert req.prompts() == [] and req.embeds_prompts() == [payload]
    both = decode_request(_body(prompt=["a", "b"], prompt_embeds=[payload] * 2), CompletionRequest)
    assert both.prompts() == ["a", "b"] and len(both.embeds_prompts()) == 2


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt_embeds": []}, "prompt_embeds"),
        ({"prompt_embeds": ""}, "prompt_embeds"),
        ({"prompt_embeds": ["x", ""]}, "prompt_embeds"),
        ({"prompt_embeds": 12}, "prompt_embeds"),
        ({"prompt_embeds": [[0.5, 0.25]]}, "prompt_embeds"),
    ],
    ids=repr,
)
def test_a_body_without_a_prompt_or_with_malformed_embeds_is_a_400(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as caught:
        decode_request(_body(**fields), CompletionRequest)
    assert caught.value.status == 400
    assert caught.value.param is not None and caught.value.param.startswith(param)  # [0]: where


def _serving() -> Serving:
    engine = SimpleNamespace(
        dead=None, hidden_size=HIDDEN, max_model_len=MAX_MODEL_LEN, vocab_size=100, intake=None,
        generation_defaults={},
    )  # fmt: skip
    return Serving(engine, Settings(served_model_names=["m"]), Metrics("m"))  # type: ignore[arg-type]


def _request(body: bytes) -> Request:
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: Any) -> None:
        raise AssertionError("no response expected")

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    return Request(scope, "/v1/completions", receive, send)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ],
    ids=repr,
)
async def test_options_that_need_the_prompt_s_tokens_are_a_400(
    fields: dict[str, Any], param: str
) -> None:
    body = _body(prompt_embeds=_saved(torch.zeros(3, HIDDEN)), **fields)

    with pytest.raises(APIError) as caught:
        await _serving().completions(_request(body))

    assert caught.value.status == 400 and caught.value.param == param


async def test_a_hostile_payload_is_a_400_from_the_endpoint(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    body = _body(prompt_embeds=_saved(_RunsACommand(f"touch {marker}")))

    with pytest.raises(APIError) as caught:
        await _serving().completions(_request(body))

    assert caught.value.status == 400 and caught.value.param == "prompt_embeds"
    assert not marker.exists()


async def test_each_payload_is_one_prompt_of_placeholder_tokens() -> None:
    payloads = [_saved(torch.zeros(3, HIDDEN)), _saved(torch.ones(1, 5, HIDDEN).bfloat16())]
    req = decode_request(_body(prompt_embeds=payloads), CompletionRequest)

    prompts = await _serving()._embeds_prompts(req)

    assert [p.token_ids for p in prompts] == [[0] * 3, [0] * 5]
    assert [tuple(p.embeds.shape) for p in prompts] == [(3, HIDDEN), (5, HIDDEN)]


@pytest.mark.parametrize(
    "view",
    [
        torch.zeros(1, HIDDEN).expand(MAX_MODEL_LEN - 1, HIDDEN),  # stride 0 over the rows
        torch.zeros(MAX_MODEL_LEN + HIDDEN).as_strided((MAX_MODEL_LEN - 1, HIDDEN), (1, 1)),
    ],
    ids=["expanded", "overlapping"],
)
def test_a_view_that_repeats_its_elements_is_refused_before_it_is_made_contiguous(
    view: torch.Tensor,
) -> None:
    payload = _saved(view)
    assert len(payload) < 4096  # the whole tensor would be 63 x 8 x 4 bytes and more

    assert "overlap" in _refused(payload).message


def test_a_view_into_a_larger_saved_storage_is_taken() -> None:
    whole = torch.arange(4 * HIDDEN, dtype=torch.float32).reshape(4, HIDDEN)
    assert torch.equal(_decode(_saved(whole[1:3])), whole[1:3])


async def test_the_decoded_bytes_of_a_request_count_once_per_choice() -> None:
    serving = _serving()
    serving.settings.max_prompt_embeds_bytes = 2 * 3 * HIDDEN * 4  # two copies of one prompt
    payload = _saved(torch.zeros(3, HIDDEN))
    taken = decode_request(_body(prompt_embeds=payload, n=2), CompletionRequest)
    assert len(await serving._embeds_prompts(taken)) == 1

    for fields in ({"n": 3}, {"prompt_embeds": [payload] * 3}):
        req = decode_request(_body(**{"prompt_embeds": payload, **fields}), CompletionRequest)
        with pytest.raises(APIError) as caught:
            await serving._embeds_prompts(req)
        assert (caught.value.status, caught.value.param) == (400, "prompt_embeds")
