"""JSON nested too deeply, inside request strings and in schemas: a 400 naming the field, never
the 500 of a RecursionError (edge/json_text.py and where it is used)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from triode.edge import json_text
from triode.edge.completions.request_bodies import ChatCompletionRequest, decode_request
from triode.edge.completions.structured import structured_outputs_of
from triode.edge.errors import APIError
from triode.edge.responses.input_items import input_messages
from triode.edge.tools.choice import check_tool_messages, parse_tools, prepare_messages

DEPTH = json_text.MAX_DEPTH


def arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def objects(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ("[]", 1),
        (arrays(DEPTH), DEPTH),
        (objects(7), 7),
        ('{"a": "[[[[{{{", "b": [1, "]]]"]}', 2),  # brackets inside strings do not count
        ('["\\"[[[", [[]]]', 3),  # nor after an escaped quote
        ("[" * 100_000, 100_000),  # unterminated
        ('"[[[[', 4),  # an unterminated string is no string: not JSON, its brackets count
    ],
)
def test_depth_counts_brackets_outside_strings(text: str, depth: int) -> None:
    assert json_text.depth(text) == depth


def test_loads_takes_max_depth_and_refuses_one_more() -> None:
    assert json_text.loads(arrays(DEPTH)) is not None
    for text in (arrays(DEPTH + 1), arrays(100_000), "[" * 100_000):
        with pytest.raises(json_text.TooDeep):
            json_text.loads(text)
    with pytest.raises(ValueError):
        json_text.loads("{not json")


def test_check_depth_of_a_decoded_value() -> None:
    json_text.check_depth(json.loads(objects(DEPTH)))
    with pytest.raises(json_text.TooDeep):
        json_text.check_depth(json.loads(objects(DEPTH + 1)))


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_json": objects(100_000)}, "guided_json"),
        ({"structured_outputs": {"json": arrays(100_000)}}, "structured_outputs.json"),
        ({"guided_json": json.loads(objects(DEPTH + 1))}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": json.loads(objects(DEPTH + 1))},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_deeply_nested_schema_is_a_400_naming_its_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as caught:
        structured_outputs_of(_chat(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)
    assert "nested more than" in caught.value.message


def test_deeply_nested_tool_call_arguments_are_a_400_naming_them() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": arrays(100_000)}},
            ],
        },
    ]  # fmt: skip
    with pytest.raises(APIError) as caught:
        check_tool_messages(messages)
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"


def test_arguments_that_are_not_json_are_still_passed_on_as_text() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    messages = [{"role": "assistant", "tool_calls": [call]}]
    check_tool_messages(messages)
    tools = parse_tools([{"type": "function", "function": {"name": "f"}}])
    from triode.edge.tools.choice import parse_tool_choice

    prepared, _ = prepare_messages(
        messages, tools, parse_tool_choice(None, tools), renders_tools=True
    )
    assert prepared[0]["tool_calls"][0]["function"]["arguments"] == "{oops"


def test_deeply_nested_tool_parameters_are_a_400_naming_them() -> None:
    tool = {"type": "function",
            "function": {"name": "f", "parameters": {"type": "object",
                                                     "x": json.loads(objects(DEPTH))}}}  # fmt: skip
    with pytest.raises(APIError) as caught:
        parse_tools([tool])
    assert caught.value.param == "tools[0].function.parameters"


@pytest.mark.parametrize("kind", ["function_call", "mcp_call"])
def test_deeply_nested_responses_call_arguments_are_a_400_naming_them(kind: str) -> None:
    item: dict[str, Any] = {"type": kind, "name": "f", "arguments": objects(100_000)}
    item |= {"call_id": "c1"} if kind == "function_call" else {"server_label": "s"}
    with pytest.raises(APIError) as caught:
        input_messages([item], mcp_name=lambda server, tool: f"{server}__{tool}")
    assert caught.value.param == "input[0].arguments"
