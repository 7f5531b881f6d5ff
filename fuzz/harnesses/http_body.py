"""HTTP request bodies: reading (`Request.read_body`), decoding (`decode_request`) and the
translation into the engine's `SamplingParams` (`sampling_params`); for `/v1/responses`, the
checks before a response is planned (tools, MCP tool entries, input items, tool choice and text
format).

Every failure must be an `APIError` with status 400, 404 or 413 and a well-formed OpenAI error
body: never a 5xx, never another exception. What is accepted must be usable as it is: chat
messages convert to the template's dicts, completion prompts are non-empty, and the sampling
parameters, split into the engine's per-sequence requests, cross the wire to the engine core and
decode there to the same values (a request the engine cannot decode would never be answered).

Input layout: an 8-byte header (request kind, mode, prompt length, model length, mutation seed)
and the body. Mode bit 0 mutates the body as JSON (wrong types, huge or non-finite numbers,
deep nesting, huge arrays and strings, unicode and surrogate escapes, unknown and missing
fields) with a `random.Random` seeded from the header; bit 1 reads the body through
`Request.read_body` in random chunks under a declared `content-length` that may lie.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import msgspec

from triode.actors.generate_call import split_params
from triode.edge.completions.request_bodies import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
    decode_request,
)
from triode.edge.completions.sampling import sampling_params
from triode.edge.completions.structured import structured_from_text_format
from triode.edge.errors import APIError, error_body
from triode.edge.http import ClientDisconnected, Request
from triode.edge.lora_names import model_not_found
from triode.edge.responses.input_items import input_messages
from triode.edge.responses.request import ResponsesRequest, decode_responses_request, mcp_tool_specs
from triode.edge.tools.choice import parse_tool_choice, parse_tools
from triode.wire import (
    Encoder,
    EngineCoreRequest,
    EngineCoreRequestType,
    InputDecoder,
    encode_input,
)

from .wire import assert_wire_equal

KINDS: list[type[Any]] = [
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    ResponsesRequest,
]
HEADER = 8
SERVED_MODEL_NAMES = ["SmolLM2-135M-Instruct"]
MAX_BODY_SIZE = 1 << 16  # small, so that mutated bodies reach the 413
VOCAB_SIZE = 49152  # the default model's; token ids at or past it are refused by the serving layer
ALLOWED_STATUSES = {400, 404, 413}

DICTIONARY = [b'"', b"{", b"}", b"[", b"]", b":", b",", b"null", b"true", b"false", b"-0",
              b"1e308", b"1e999", b"NaN", b"9223372036854775808", b"18446744073709551616",
              b'"\\ud800"', b'"\\ud83d\\ude00"', b"\\u0000", b'"role"', b'"content"',
              b'"messages"', b'"prompt"', b'"tokens"', b'"n"', b'"seed"', b'"top_k"', b'"stop"',
              b'"logit_bias"', b'"stream"', b'"stream_options"', b'"max_tokens"', b'"type"',
              b'"text"', b'"user"', b'"model"', b"[[[[[[[[", b"\xff", b"\xed\xa0\x80"]  # fmt: skip

_ENCODER = Encoder()
_INPUT = InputDecoder()


def body_input(
    kind: type[Any],
    body: bytes,
    *,
    mode: int = 0,
    prompt_len: int = 12,
    max_model_len: int = 8192,
    mutation_seed: int = 0,
) -> bytes:
    """The input that runs `body` as a `kind` request (for seed corpora)."""
    header = bytes([KINDS.index(kind), mode])
    header += prompt_len.to_bytes(2, "little") + max_model_len.to_bytes(2, "little")
    return header + mutation_seed.to_bytes(2, "little") + body


def test_one_input(data: bytes) -> None:
    header = data[:HEADER].ljust(HEADER, b"\0")
    kind = KINDS[header[0] % len(KINDS)]
    mode = header[1]
    prompt_len = int.from_bytes(header[2:4], "little")
    max_model_len = 2 + int.from_bytes(header[4:6], "little")
    rng = random.Random(int.from_bytes(header[6:8], "little"))
    body = data[HEADER:]
    if mode & 1:
        body = mutate_json(body, rng, kind)
    try:
        if mode & 2:
            body = _read_through_asgi(body, rng)
        if kind is ResponsesRequest:
            req = decode_responses_request(body)
        else:
            req = decode_request(body, kind)
        if req.model is not None and req.model not in SERVED_MODEL_NAMES:
            raise model_not_found(req.model)  # no adapter is loaded here
    except APIError as e:
        _check_error(e)
        return
    _check_accepted(req, prompt_len, max_model_len)


def _check_accepted(req: Any, prompt_len: int, max_model_len: int) -> None:
    if isinstance(req, ResponsesRequest):
        _check_response(req)
        return
    if isinstance(req, TokenizeRequest):
        assert (req.prompt is None) != (req.messages is None)
        assert isinstance(req.add_special_tokens, bool)
        if req.messages is not None:
            _check_messages(req.messages)
        return
    if isinstance(req, DetokenizeRequest):
        assert all(type(t) is int and t >= 0 for t in req.tokens)
        return
    if isinstance(req, ChatCompletionRequest):
        _check_messages(req.messages)
    else:
        prompts = req.prompts()
        assert prompts or req.embeds_prompts(), "no prompts"
        assert all(req.embeds_prompts()), "an empty prompt_embeds was accepted"
        for prompt in prompts:
            assert prompt, "an empty prompt was accepted"
            assert isinstance(prompt, str) or all(type(t) is int and t >= 0 for t in prompt)
    try:
        params = sampling_params(req, prompt_len=prompt_len, max_model_len=max_model_len)
    except APIError as e:
        _check_error(e)
        return
    assert params.max_tokens is not None and prompt_len + params.max_tokens <= max_model_len
    if _refused_token_ids(params):
        return
    for i, child in enumerate(split_params(params)):
        request = EngineCoreRequest(f"cmpl-{i}", [1], child, 2)
        frames = [
            bytes(f) for f in encode_input(_ENCODER, EngineCoreRequestType.ADD_REQUEST, request)
        ]
        kind, decoded = _INPUT.decode(frames)  # a ProtocolError here fails the input
        assert kind is EngineCoreRequestType.ADD_REQUEST
        assert_wire_equal(decoded, request)


def _check_response(req: ResponsesRequest) -> None:
    """What `plan_response` checks before it needs the engine or a tool server."""
    try:
        tools = parse_tools(req.tools, param="tools", flat=True)
        specs = mcp_tool_specs(req.tools)
        messages = input_messages(req.input, mcp_name=lambda label, tool: f"{label}__{tool}")
        fmt = req.text.format if req.text is not None else None
        if fmt is not None:
            structured_from_text_format(fmt, param="text.format")
        choice = req.tool_choice
        if not (isinstance(choice, dict) and choice.get("type") == "mcp"):
            parse_tool_choice(choice, tools, param="tool_choice", flat=True)
    except APIError as e:
        _check_error(e)
        return
    assert len({spec.server_label for _, spec in specs}) == len(specs)
    for message in messages:
        assert isinstance(message, dict) and isinstance(message.get("role"), str), message


def _refused_token_ids(params: Any) -> bool:
    # The serving layer checks token ids against the vocabulary after `sampling_params`.
    ids = [*params.stop_token_ids, *(params.allowed_token_ids or ()), *(params.logit_bias or ())]
    return bool(ids) and max(ids) >= VOCAB_SIZE


def _check_messages(messages: list[ChatMessage]) -> None:
    for message in msgspec.to_builtins(messages):
        assert message["role"] in ("system", "developer", "user", "assistant", "tool")
        content = message.get("content")
        assert (
            content is None
            or isinstance(content, str)
            or all(part["type"] == "text" and isinstance(part["text"], str) for part in content)
        )


def _check_error(e: APIError) -> None:
    assert e.status in ALLOWED_STATUSES, f"status {e.status}: {e.message}"
    assert isinstance(e.message, str) and e.message
    assert e.param is None or isinstance(e.param, str)
    shape = msgspec.json.decode(error_body(e))
    assert set(shape) == {"error"}
    assert set(shape["error"]) == {"message", "type", "param", "code"}


# Reading the body as the ASGI app does


def _read_through_asgi(body: bytes, rng: random.Random) -> bytes:
    cuts = sorted(rng.randrange(len(body) + 1) for _ in range(rng.randrange(4)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    messages = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    declared = rng.choice(
        [
            str(len(body)).encode(),
            None,
            str(rng.randrange(2 * MAX_BODY_SIZE)).encode(),
            b"9" * rng.choice([20, 4301, 10_000]),
            b"-1",
            b" 12",
            "١٢".encode(),
            b"0x10",
        ]
    )
    headers = [] if declared is None else [(b"content-length", declared)]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        raise AssertionError("reading a body sent a response")

    request = Request(scope, scope["path"], receive, send)
    coro = request.read_body(MAX_BODY_SIZE)
    try:
        coro.send(None)
    except StopIteration as done:
        read = done.value
    except ClientDisconnected as e:
        raise AssertionError("the whole body was there, but reading it saw a disconnect") from e
    else:
        coro.close()
        raise AssertionError("read_body waited although every message was ready")
    assert read == body
    assert len(read) <= MAX_BODY_SIZE, "a body over the limit was read whole"
    return read


# JSON-aware mutation

# JSON text that json.dumps never writes, spliced in through placeholder strings.
_RAW = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "-0",
    "1E-400",
    "1" + "0" * 400,
    "-" + "9" * 30,
    '"\\ud800"',
    '"\\udc00\\ud800"',
    '"\\ud83d\\ude00"',
    '"\\u0000"',
    '"\\ud800x"',
    "[" * 600 + "]" * 600,
    '{"a":' * 600 + "0" + "}" * 600,
    "[" * 20_000 + "]" * 20_000,
    "true ",
    "0.0000000000000000000000000000001",
]
_PLACEHOLDER = "\x00raw:"

_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    129,
    0.5,
    -0.0,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    1e308,
    -1e308,
    5e-324,
    "",
    "x",
    "NaN",
    "Infinity",
    "-1",
    "1e308",
    "\u0000",
    "\U0001f600",
    "\u202e",
    "{{ 7*7 }}",
    "{% for x in range(9) %}x{% endfor %}",
    "<|im_end|>",
    "text",
    "user",
    "system",
    "assistant",
    [],
    {},
    [0],
    ["x"],
    {"type": "text", "text": "x"},
    {"type": "image_url", "image_url": {"url": "x"}},
    {"role": "user", "content": "x"},
    {"include_usage": True},
    {"type": "text"},
]

_FIELDS = sorted(
    {
        name
        for struct in (*KINDS, ChatMessage, ContentPart, StreamOptions)
        for name in struct.__struct_fields__
    }
)


def mutate_json(body: bytes, rng: random.Random, kind: type[Any]) -> bytes:
    """`body` with a few structure-aware mutations; unchanged when it is not JSON."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return body
    for _ in range(rng.randint(1, 4)):
        doc = _mutate(doc, rng)
    text = json.dumps(
        doc,
        ensure_ascii=rng.random() < 0.5,
        separators=rng.choice([(",", ":"), (", ", ": ")]),
    )
    for i, raw in enumerate(_RAW):
        text = text.replace(json.dumps(f"{_PLACEHOLDER}{i}"), raw)
    return text.encode("utf-8", "surrogatepass")


def _value(rng: random.Random, doc: Any) -> Any:
    """A fresh value: nothing in the result is shared with `doc` or with other inputs."""
    pick = rng.randrange(10)
    if pick == 0:
        return f"{_PLACEHOLDER}{rng.randrange(len(_RAW))}"
    if pick == 1:
        size = rng.choice([999, 20_000, 70_000])
        return rng.choice([[0] * size, "a" * size, ["s"] * size, {str(i): i for i in range(size)}])
    if pick == 2:
        nodes = _nodes(doc)
        return copy.deepcopy(_get(*rng.choice(nodes))) if nodes else None
    return copy.deepcopy(rng.choice(_VALUES))


def _nodes(doc: Any) -> list[tuple[Any, Any]]:
    """(container, key or index) of every value below the root."""
    out: list[tuple[Any, Any]] = []
    stack = [doc]
    while stack and len(out) < 500:
        node = stack.pop()
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for key, child in items:
            out.append((node, key))
            stack.append(child)
    return out


def _get(container: Any, key: Any) -> Any:
    return container[key]


def _mutate(doc: Any, rng: random.Random) -> Any:
    nodes = _nodes(doc)
    op = rng.randrange(7)
    if op == 0 or not nodes:  # add a field, known or not, at the top or in a nested object
        objects = [doc, *(_get(*n) for n in nodes)]
        objects = [o for o in objects if isinstance(o, dict)]
        if not objects:
            return _value(rng, doc)
        name = rng.choice(_FIELDS) if rng.random() < 0.8 else rng.choice(["", "x", "__class__"])
        rng.choice(objects)[name] = _value(rng, doc)
        return doc
    container, key = rng.choice(nodes)
    if op == 1:  # delete
        del container[key]
    elif op == 2:  # wrap
        container[key] = rng.choice([[container[key]], {"x": container[key]}])
    elif (
        op == 3 and isinstance(container[key], int | float) and not isinstance(container[key], bool)
    ):
        number = container[key]
        container[key] = rng.choice([number + 1, number - 1, -number, number * 10**20, str(number)])
    elif op == 4 and isinstance(container[key], str):
        text = container[key]
        cut = rng.randrange(len(text) + 1)
        extra = rng.choice(["\u0000", "\r\n", "\ud800", "\U0001f600", "\\", "{{", "\u0301", "é"])
        container[key] = text[:cut] + extra + text[cut:]
    else:  # replace
        container[key] = _value(rng, doc)
    return doc
