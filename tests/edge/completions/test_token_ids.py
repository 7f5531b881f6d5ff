"""`return_token_ids`, `return_tokens_as_token_ids` (vLLM's request fields) and the weights'
version on chat and completions answers, whole and streamed, against a real server: the ids are
the engine's own (those /tokenize gives for the prompt, those that decode to the answer's text).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
from integration.server import Server, running_server
from processes import alive

from triode.edge.completions.request_bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
)
from triode.edge.errors import APIError

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0}
# what goes in `extra_body`: every answer runs to max_tokens, with the ids, or also the logprobs'
# tokens named by id
PLAIN = {"ignore_eos": True}
IDS = {**PLAIN, "return_token_ids": True}
NAMED = {**IDS, "return_tokens_as_token_ids": True}


@pytest.mark.parametrize("kind", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize("field", ["return_token_ids", "return_tokens_as_token_ids"])
def test_the_fields_are_booleans_or_a_400_naming_them(kind: type, field: str) -> None:
    base = {"messages": MESSAGES} if kind is ChatCompletionRequest else {"prompt": PROMPT}
    for value in (True, False, None):
        assert getattr(decode_request(_json({**base, field: value}), kind), field) is value
    with pytest.raises(APIError) as refused:
        decode_request(_json({**base, field: "yes"}), kind)
    assert refused.value.status == 400 and refused.value.param == field


def _json(body: dict[str, Any]) -> bytes:
    return msgspec.json.encode(body)


# A real server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """tiny-random in fp32 with the admin routes and no API key (the start-up warns)."""
    log = tmp_path_factory.mktemp("token-ids") / "serve.log"
    args = ["tiny-random", "--dtype", "float32", "--max-model-len", "256", "--enable-admin-api"]
    with running_server(args, log) as s:
        pids = [s.process.pid, s.engine_pid()]
        yield s
    assert not any(alive(pid) for pid in pids)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _extra(answer: Any, name: str) -> Any:
    """A field the openai client's types lack (vLLM's and triode's extra ones)."""
    assert answer.model_extra is not None and name in answer.model_extra, name
    return answer.model_extra[name]


def _tokenize(server: Server, **body: Any) -> list[int]:
    tokens: list[int] = httpx.post(f"{server.url}/tokenize", json=body, timeout=10).json()["tokens"]
    return tokens


def _decodes_to(server: Server, ids: list[int], text: str) -> None:
    decoded = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=10).json()
    # an answer's text holds back a character whose bytes the last token only began
    assert decoded["prompt"].removesuffix("\ufffd") == text


@pytest.mark.slow
def test_completion_answers_carry_the_prompts_and_the_generated_ids(
    server: Server, client: openai.OpenAI
) -> None:
    prompts = [PROMPT, "Once upon a time"]
    answer = client.completions.create(
        model="tiny-random", prompt=prompts, extra_body=IDS, **GREEDY
    )
    assert _extra(answer, "weight_version") == 0
    for choice, prompt in zip(answer.choices, prompts, strict=True):
        assert _extra(choice, "prompt_token_ids") == _tokenize(server, prompt=prompt)
        assert len(_extra(choice, "token_ids")) == GREEDY["max_tokens"]
        _decodes_to(server, _extra(choice, "token_ids"), choice.text)
    # echoed: the text starts with the prompt, the generated ids stay the generated ones
    echoed = client.completions.create(
        model="tiny-random", prompt=PROMPT, echo=True, extra_body=IDS, **GREEDY
    )
    [first, _] = answer.choices
    assert echoed.choices[0].text == PROMPT + first.text
    assert _extra(echoed.choices[0], "token_ids") == _extra(first, "token_ids")
    # not asked for: null
    plain = client.completions.create(
        model="tiny-random", prompt=PROMPT, extra_body=PLAIN, **GREEDY
    )
    assert _extra(plain.choices[0], "token_ids") is None
    assert _extra(plain.choices[0], "prompt_token_ids") is None


@pytest.mark.slow
def test_a_completion_stream_carries_each_deltas_ids_and_the_prompts_once(
    server: Server, client: openai.OpenAI
) -> None:
    whole = client.completions.create(
        model="tiny-random", prompt=PROMPT, n=2, extra_body=IDS, **GREEDY
    )
    chunks = list(
        client.completions.create(
            model="tiny-random", prompt=PROMPT, n=2, stream=True, logprobs=0, extra_body=IDS,
            **GREEDY,
        )
    )  # fmt: skip
    prompt_ids = _tokenize(server, prompt=PROMPT)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert _extra(mine[0], "prompt_token_ids") == prompt_ids
        assert all(_extra(c, "prompt_token_ids") is None for c in mine[1:])
        ids = [t for c in mine for t in _extra(c, "token_ids")]
        assert ids == _extra(whole.choices[index], "token_ids")
        for c in mine:  # each chunk's ids are its delta's: as many as its logprobs
            assert c.logprobs is not None
            assert len(_extra(c, "token_ids")) == len(c.logprobs.tokens or ())
    assert all(_extra(c, "weight_version") == 0 for c in chunks)


@pytest.mark.slow
def test_completion_logprobs_name_tokens_by_id(server: Server, client: openai.OpenAI) -> None:
    named = client.completions.create(
        model="tiny-random", prompt=PROMPT, logprobs=2, echo=True, extra_body=NAMED,
        **GREEDY,
    )  # fmt: skip
    texts = client.completions.create(
        model="tiny-random", prompt=PROMPT, logprobs=2, echo=True, extra_body=PLAIN, **GREEDY
    )
    [choice], [text_choice] = named.choices, texts.choices
    assert choice.logprobs is not None and text_choice.logprobs is not None
    ids = _tokenize(server, prompt=PROMPT) + _extra(choice, "token_ids")
    assert choice.logprobs.tokens == [f"token_id:{i}" for i in ids]
    assert choice.logprobs.token_logprobs == text_choice.logprobs.token_logprobs
    # offsets still count in the text
    assert choice.logprobs.text_offset == text_choice.logprobs.text_offset
    for named_top, text_top in zip(
        choice.logprobs.top_logprobs or [], text_choice.logprobs.top_logprobs or [], strict=True
    ):
        if text_top is None:
            assert named_top is None
            continue
        assert named_top is not None
        assert all(key.startswith("token_id:") for key in named_top)
        # tokens that decode to the same text share one key of the text map; ids never do
        assert set(text_top.values()) <= set(named_top.values())
        assert len(text_top) <= len(named_top) <= 3  # the top 2 and the token taken


@pytest.mark.slow
def test_chat_answers_carry_the_prompts_and_the_generated_ids(
    server: Server, client: openai.OpenAI
) -> None:
    answer = client.chat.completions.create(
        model="tiny-random", messages=MESSAGES, logprobs=True, top_logprobs=2,
        extra_body=NAMED, **GREEDY,
    )  # fmt: skip
    prompt_ids = _tokenize(server, messages=MESSAGES)
    assert _extra(answer, "prompt_token_ids") == prompt_ids
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)
    assert _extra(answer, "weight_version") == 0
    [choice] = answer.choices
    ids = _extra(choice, "token_ids")
    assert len(ids) == GREEDY["max_tokens"]
    _decodes_to(server, ids, choice.message.content or "")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [e.token for e in choice.logprobs.content] == [f"token_id:{i}" for i in ids]
    for entry in choice.logprobs.content:  # the bytes are still the tokens' text's
        assert entry.bytes and not bytes(entry.bytes).startswith(b"token_id:")
        assert len(entry.top_logprobs) == 2
        for top in entry.top_logprobs:
            assert top.token.startswith("token_id:") and top.bytes
            assert not bytes(top.bytes).startswith(b"token_id:")
    plain = client.chat.completions.create(
        model="tiny-random", messages=MESSAGES, extra_body=PLAIN, **GREEDY
    )
    assert _extra(plain, "prompt_token_ids") is None
    assert _extra(plain.choices[0], "token_ids") is None
    assert plain.choices[0].message.content == choice.message.content


@pytest.mark.slow
def test_a_chat_stream_carries_the_prompts_ids_first_then_each_deltas(
    server: Server, client: openai.OpenAI
) -> None:
    whole = client.chat.completions.create(
        model="tiny-random",
        messages=MESSAGES,
        extra_body=IDS,
        **GREEDY,
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-random", messages=MESSAGES, stream=True, extra_body=IDS,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    first, rest = chunks[0], chunks[1:]
    assert first.choices[0].delta.role == "assistant"
    assert _extra(first, "prompt_token_ids") == _extra(whole, "prompt_token_ids")
    assert all(_extra(c, "prompt_token_ids") is None for c in rest)
    ids = [t for c in rest for choice in c.choices for t in _extra(choice, "token_ids")]
    assert ids == _extra(whole.choices[0], "token_ids")
    text = "".join(choice.delta.content or "" for c in rest for choice in c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert all(_extra(c, "weight_version") == 0 for c in chunks)


@pytest.mark.slow
def test_the_model_card_has_the_weights_version_and_the_start_up_warned(
    server: Server, client: openai.OpenAI
) -> None:
    [card] = client.models.list().data
    assert _extra(card, "weight_version") == 0
    assert "--enable-admin-api without API keys" in server.output()
    # and without a key, the admin routes are open to whoever reaches the port
    assert httpx.get(f"{server.url}/is_paused", timeout=10).json() == {"is_paused": False}
