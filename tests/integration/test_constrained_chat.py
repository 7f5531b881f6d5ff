"""Structured output and tool calling through `triode serve` on the real default model, driven
by the `openai` client: constrained answers parse and validate on many prompts and seeds,
streamed or not; required and named tool calls match their functions' schemas, stream as deltas
that reassemble, and feed a next turn; and bad constraints, tools and tool messages are 400s that
leave the engine untouched."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from conftest import API_KEYS, SERVED_NAME
from server import Server, idle

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Rome", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person as JSON.",
    "Who lives in the city? Answer in JSON.",
    "Invent a character for a novel.",
    "Give me a user profile.",
]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/api/v1", api_key=API_KEYS[0], max_retries=0)


def test_json_schema_answers_validate_across_prompts_and_seeds(server: Server) -> None:
    client = _client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(prompt: str, seed: int | None) -> None:
        answer = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=120,
            temperature=0 if seed is None else 1.0,
            seed=seed,
            response_format=fmt,  # type: ignore[arg-type]
        )
        [choice] = answer.choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)

    # concurrently, so the constrained rows share batches (and their masks one step)
    with ThreadPoolExecutor(8) as pool:
        asks = [(p, seed) for i, p in enumerate(PROMPTS) for seed in (None, 11 * i + 1)]
        for done in [pool.submit(ask, p, seed) for p, seed in asks]:
            done.result()


def test_a_streamed_constrained_answer_reassembles_to_the_whole_one(server: Server) -> None:
    client = _client(server)
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 120,
        "temperature": 0,
        "extra_body": {"guided_json": PERSON},
    }
    whole = client.chat.completions.create(**body).choices[0].message.content  # type: ignore[call-overload]
    chunks = client.chat.completions.create(stream=True, **body)  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


def test_choice_regex_and_grammar_in_completions(server: Server) -> None:
    client = _client(server)
    cities = ["Paris", "Lyon", "Marseille"]
    cases = [
        ({"guided_choice": cities}, lambda t: t in cities),
        ({"structured_outputs": {"regex": r"[0-9]{4}"}}, lambda t: len(t) == 4 and t.isdigit()),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]  # fmt: skip
    for extra, check in cases:
        answer = client.completions.create(
            model=SERVED_NAME,
            prompt="The capital of France is",
            max_tokens=12,
            temperature=0,
            extra_body=extra,
        )
        text = answer.choices[0].text
        assert check(text), (extra, text)
        assert answer.choices[0].finish_reason == "stop"


def test_bad_constraints_are_400s_before_the_engine(server: Server) -> None:
    client = _client(server)
    nope = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    bad = [
        ({"response_format": nope}, "response_format"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=SERVED_NAME,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_body=extra,
            )
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]
    assert idle(server)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _checked_calls(calls: list[Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """The (name, arguments) of each call, each checked against its function's schema."""
    assert calls, "no tool calls"
    found = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        found.append((call.function.name, arguments))
    assert len({c.id for c in calls}) == len(calls)
    return found


def test_a_required_choice_calls_valid_tools_and_stops_before_repeating(server: Server) -> None:
    client = _client(server)
    for seed in (None, 3, 5):
        answer = client.chat.completions.create(
            model=SERVED_NAME, messages=ASK_WEATHER, tools=[WEATHER, CLOCK],
            tool_choice="required", max_tokens=400, temperature=0 if seed is None else 1.0,
            seed=seed,
        )  # type: ignore[call-overload]  # fmt: skip
        [choice] = answer.choices
        assert choice.finish_reason == "tool_calls", choice
        calls = _checked_calls(choice.message.tool_calls)
        # the small model repeats calls when let; a repeat ends the answer, not max_tokens
        assert len({json.dumps(c, sort_keys=True) for c in calls}) == len(calls)
        assert answer.usage is not None and answer.usage.completion_tokens < 400
    assert idle(server)


def test_a_named_call_streams_deltas_that_reassemble_to_the_whole_answer(server: Server) -> None:
    client = _client(server)
    body: dict[str, Any] = {
        "model": SERVED_NAME, "messages": ASK_WEATHER, "tools": [WEATHER, CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 60, "temperature": 0,
    }  # fmt: skip
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls"
    [(name, arguments)] = _checked_calls(whole.message.tool_calls)
    assert name == "get_weather"

    parts: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or ():
                part = parts.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                part["id"] += d.id or ""
                part["name"] += (d.function and d.function.name) or ""
                part["arguments"] += (d.function and d.function.arguments) or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == [(name, arguments)]
    assert parts[0]["id"].startswith("call_")


def test_a_tool_result_reaches_the_next_turn(server: Server) -> None:
    client = _client(server)
    first = client.chat.completions.create(
        model=SERVED_NAME, messages=ASK_WEATHER, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0,
    ).choices[0].message  # fmt: skip
    [call] = first.tool_calls or []
    history = [
        *ASK_WEATHER,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 31}'},
    ]  # fmt: skip
    second = client.chat.completions.create(
        model=SERVED_NAME, messages=history, tools=[WEATHER], tool_choice="none",  # type: ignore[arg-type]
        max_tokens=40, temperature=0,
    ).choices[0]  # fmt: skip
    assert not second.message.tool_calls and second.finish_reason in ("stop", "length")
    assert second.message.content and "31" in second.message.content

    auto = client.chat.completions.create(
        model=SERVED_NAME, messages=history, tools=[WEATHER], max_tokens=60,  # type: ignore[arg-type]
        temperature=0,
    ).choices[0]  # fmt: skip
    assert auto.message.content or auto.message.tool_calls  # free text: either is an answer


def test_bad_tools_and_tool_messages_are_400s(server: Server) -> None:
    client = _client(server)
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ]}  # fmt: skip
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
         "tools[0].function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [*ASK_WEATHER, assistant, {"role": "tool", "content": "31"}]},
         "messages[2].tool_call_id"),
    ]  # fmt: skip
    for extra, param in bad:
        body = {"model": SERVED_NAME, "messages": ASK_WEATHER, "max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**body)
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]
    assert idle(server)
