"""The Responses API's bodies: request decoding and its 400s, input items as chat messages, the
event stream `ResponseBuilder` writes (checked with the openai SDK's own stream accumulator),
and the store's eviction."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import trio
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from triode.edge.errors import APIError
from triode.edge.responses.input_items import input_messages
from triode.edge.responses.output import ResponseBuilder
from triode.edge.responses.request import MAX_INSTRUCTIONS, decode_responses_request, mcp_tool_specs
from triode.edge.responses.response import (
    McpListTools,
    McpToolInfo,
    Response,
    ResponseUsage,
    output_text,
)
from triode.edge.responses.store import ResponseStore, StoredResponse
from triode.edge.sse import SSEParser


def _decode(**body: Any) -> Any:
    return decode_responses_request(json.dumps({"input": "hi", **body}).encode())


def _refused(call: Any, *args: Any, **kwargs: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args, **kwargs)
    assert caught.value.status == 400
    return caught.value


def _mcp_name(label: str, tool: str) -> str:
    return f"{label}__{tool}"


# Requests


def test_a_minimal_request_decodes_with_the_api_defaults() -> None:
    req = _decode(model="m")

    assert (req.input, req.model, req.store, req.stream, req.background) == (
        "hi", "m", True, False, False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"background": True, "store": False}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata[...]"),
        ({"instructions": "x" * (MAX_INSTRUCTIONS + 1)}, "instructions"),
        ({"text": {"format": {"type": "text"}, "colour": 1}}, "text.colour"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"prompt": {"id": "p"}}, "prompt"),
        ({"input": 7}, "input"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    error = _refused(_decode, **body)

    assert error.param == param and error.message.startswith(param)


def test_a_missing_input_and_invalid_json_are_400s() -> None:
    assert _refused(decode_responses_request, b'{"model": "m"}').param == "input"
    assert "invalid JSON" in _refused(decode_responses_request, b'{"input": ').message


def test_cache_salt_is_a_bounded_non_empty_string_or_a_400_naming_it() -> None:
    from triode.edge.completions.request_bodies import MAX_CACHE_SALT

    assert _decode().cache_salt is None
    assert _decode(cache_salt="x" * MAX_CACHE_SALT).cache_salt == "x" * MAX_CACHE_SALT
    for bad in ["", "x" * (MAX_CACHE_SALT + 1), 5, [], {"a": 1}]:
        error = _refused(_decode, cache_salt=bad)
        assert error.param == "cache_salt" and error.message.startswith("cache_salt: "), bad


def test_tools_other_than_function_and_mcp_are_refused() -> None:
    tools = [{"type": "function", "name": "f"}, {"type": "web_search"}]

    error = _refused(mcp_tool_specs, tools)

    assert error.param == "tools[1].type" and "web_search" in error.message


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"require_approval": "always"}, "tools[0].require_approval"),
        ({"require_approval": {"always": {"tool_names": ["add"]}}}, "tools[0].require_approval"),
        ({"server_label": "bad label"}, "tools[0].server_label"),
        ({"server_label": None}, "tools[0].server_label"),
        ({"headers": {"Authorization": "x"}}, "tools[0].headers"),
        ({"allowed_tools": {"read_only": True}}, "tools[0].allowed_tools"),
        ({"surprise": 1}, "tools[0].surprise"),
    ],
)
def test_a_bad_mcp_tool_is_a_400_naming_its_field(tool: dict[str, Any], param: str) -> None:
    spec = {"type": "mcp", "server_label": "calc", **tool}

    assert _refused(mcp_tool_specs, [spec]).param == param


def test_mcp_tools_are_read_with_their_allowed_tools() -> None:
    tools = [
        {"type": "function", "name": "f"},
        {"type": "mcp", "server_label": "a", "allowed_tools": ["add"], "require_approval": "never"},
        {"type": "mcp", "server_label": "b", "allowed_tools": {"tool_names": ["x", "y"]}},
        {"type": "mcp", "server_label": "c", "server_url": "http://h/sse"},
    ]

    specs = mcp_tool_specs(tools)

    assert [(i, s.server_label, s.allowed()) for i, s in specs] == [
        (1, "a", {"add"}), (2, "b", {"x", "y"}), (3, "c", None),
    ]  # fmt: skip
    assert specs[2][1].server_url == "http://h/sse"
    twice = [tools[1], tools[1]]
    assert _refused(mcp_tool_specs, twice).param == "tools[1].server_label"


# Input items


def test_a_string_input_is_one_user_message() -> None:
    assert input_messages("hello", mcp_name=_mcp_name) == [{"role": "user", "content": "hello"}]


def test_message_items_keep_their_roles_and_join_their_text_parts() -> None:
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": [], "logprobs": []}]},
    ]  # fmt: skip

    assert input_messages(items, mcp_name=_mcp_name) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
    ]


def test_calls_join_the_assistant_turn_and_outputs_become_tool_messages() -> None:
    items = [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city":"Rome"}',
         "id": "fc_2", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
    ]  # fmt: skip

    messages = input_messages(items, mcp_name=_mcp_name)

    assert messages[1] == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "w", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "w", "arguments": '{"city":"Rome"}'}},
        ],
    }  # fmt: skip
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_an_output_answers_a_call_of_the_history_or_is_a_400() -> None:
    history = [{"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "w", "arguments": "{}"}}]}]  # fmt: skip
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}

    assert input_messages([output], mcp_name=_mcp_name, history=history) == [
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    ]
    error = _refused(input_messages, [output], mcp_name=_mcp_name)
    assert error.param == "input[0].call_id" and "c1" in error.message


def test_mcp_items_replay_as_the_call_the_model_made_and_its_result() -> None:
    items = [
        {"type": "mcp_list_tools", "id": "l", "server_label": "calc", "tools": []},
        {"type": "mcp_call", "id": "mcp_1", "server_label": "calc", "name": "add",
         "arguments": '{"a":1,"b":2}', "output": "3", "error": None, "status": "completed"},
        {"type": "mcp_call", "id": "mcp_2", "server_label": "calc", "name": "fail",
         "arguments": "{}", "output": None, "status": "failed",
         "error": {"type": "mcp_tool_execution_error",
                   "content": [{"type": "text", "text": "boom"}]}},
    ]  # fmt: skip

    messages = input_messages(items, mcp_name=_mcp_name)

    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool"]
    assert messages[0]["tool_calls"][0]["function"]["name"] == "calc__add"
    assert messages[1] == {"role": "tool", "tool_call_id": "mcp_1", "content": "3"}
    assert messages[3]["content"] == "error: boom"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"content": "no role"}, "input[0].role"),
        ({"role": "robot", "content": "x"}, "input[0].role"),
        ({"role": "user", "content": [{"type": "input_image", "image_url": "u"}]},
         "input[0].content[0].type"),
        ({"role": "user", "content": [{"type": "input_text"}]}, "input[0].content[0].text"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0].arguments"),
        ({"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"},
         "input[0].call_id"),
        ({"type": "item_reference", "id": "x"}, "input[0].type"),
        ({"role": "user", "content": "x", "extra": 1}, "input[0].extra"),
    ],
)  # fmt: skip
def test_a_bad_input_item_is_a_400_naming_its_place(item: dict[str, Any], param: str) -> None:
    error = _refused(input_messages, [item], mcp_name=_mcp_name)

    assert error.param == param and error.message.startswith(param)


# The event stream


def _response() -> Response:
    return Response(id="resp_1", model="m", usage=ResponseUsage())


def _events(frames: list[bytes]) -> list[dict[str, Any]]:
    """The frames as the SDK reads them: `event:` names the type that `data` holds."""
    events = []
    for frame in frames:
        head, data = frame.split(b"\n", 1)
        [payload] = SSEParser().feed(data)
        event = json.loads(payload)
        assert head == b"event: " + event["type"].encode()
        events.append(event)
    return events


def _accumulated(frames: list[bytes]) -> Any:
    """The final response the openai SDK's stream accumulator builds from the frames; it raises
    on an event out of place (an index it has not seen, a content event before its item)."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    final = None
    for event in _events(frames):
        for parsed in state.handle_event(construct_type(type_=ResponseStreamEvent, value=event)):
            if parsed.type == "response.completed":
                final = parsed.response
    assert final is not None
    return final


def test_a_text_answer_streams_the_events_of_one_message() -> None:
    out = ResponseBuilder(_response(), streaming=True)
    out.start()
    for delta in ["Hel", "lo", "!"]:
        out.text(delta)
    out.end_turn()
    out.finish("completed")
    frames = out.take()

    events = _events(frames)

    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["output"] == [] and events[2]["item"]["content"] == []
    message_id = events[2]["item"]["id"]
    assert all(e["item_id"] == message_id for e in events[3:9])
    assert events[7]["text"] == "Hello!" and events[-1]["response"]["status"] == "completed"
    assert out.take() == []  # handed over once
    assert _accumulated(frames).output_text == "Hello!" == output_text(out.response)


def test_the_sdk_accumulates_a_text_answer_to_the_stored_response() -> None:
    out = ResponseBuilder(_response(), streaming=True)
    out.start()
    for delta in [" ", "Paris", " is", " nice."]:
        out.text(delta)
    out.end_turn()
    out.finish("completed")

    final = _accumulated(out.take())

    assert final.output_text == " Paris is nice." == output_text(out.response)
    assert final.output[0].id == out.response.output[0].id
    assert final.output[0].status == "completed"


def test_a_function_call_streams_its_arguments_and_ends_done() -> None:
    out = ResponseBuilder(_response(), streaming=True)
    out.start()
    out.text("\n")  # whitespace before a call is not a message
    out.call(0, "call_1", "get_weather", '{"city": ')
    out.call(0, None, None, '"Paris"}')
    turn = out.end_turn()
    out.finish("completed")
    frames = out.take()

    events = _events(frames)

    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2]["item"], events[6]["item"]
    assert (added["type"], added["status"], added["arguments"]) == ("function_call",
                                                                    "in_progress", "")  # fmt: skip
    assert done == {**added, "status": "completed", "arguments": '{"city": "Paris"}'}
    assert events[5]["arguments"] == '{"city": "Paris"}'
    assert turn.text == "" and [c.call_id for c in turn.calls] == ["call_1"]
    final = _accumulated(frames)
    assert [(o.type, o.name, o.call_id, o.arguments) for o in final.output] == [
        ("function_call", "get_weather", "call_1", '{"city": "Paris"}')
    ]


def test_text_then_two_calls_are_three_items_in_order() -> None:
    out = ResponseBuilder(_response(), streaming=True)
    out.start()
    out.text("Let me check.")
    out.call(0, "c1", "w", '{"city":"Paris"}')
    out.call(1, "c2", "w", '{"city":"Rome"}')
    turn = out.end_turn()
    out.finish("completed")

    final = _accumulated(out.take())

    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert final.output_text == "Let me check." == turn.text
    assert [o.status for o in out.response.output] == ["completed"] * 3


def test_an_mcp_call_stays_open_until_its_result() -> None:
    out = ResponseBuilder(_response(), streaming=True, mcp_tools={"add": ("calc", "add")})
    out.start()
    tools = [McpToolInfo(name="add", input_schema={"type": "object"})]
    listing = McpListTools(id="mcpl_1", server_label="calc", tools=tools)
    out.list_tools(listing)
    out.call(0, "ignored", "add", '{"a": 2, "b": 3}')
    [call] = out.end_turn().calls
    out.mcp_result(call, "5", None)
    out.text("It is 5.")
    out.end_turn()
    out.finish("completed")
    frames = out.take()

    types = [e["type"] for e in _events(frames)]

    assert types[2:6] == [
        "response.output_item.added",
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
        "response.output_item.done",
    ]
    assert types[6:12] == [
        "response.output_item.added",
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_call.in_progress",
        "response.mcp_call.completed",
        "response.output_item.done",
    ]
    final = _accumulated(frames)
    assert [o.type for o in final.output] == ["mcp_list_tools", "mcp_call", "message"]
    mcp = final.output[1]
    assert (mcp.server_label, mcp.name, mcp.output, mcp.error, mcp.status) == (
        "calc", "add", "5", None, "completed",
    )  # fmt: skip
    assert final.output_text == "It is 5."


def test_a_failed_mcp_call_and_a_down_server_carry_their_errors() -> None:
    out = ResponseBuilder(_response(), streaming=True, mcp_tools={"fail": ("calc", "fail")})
    out.start()
    out.list_tools(McpListTools(id="mcpl_1", server_label="down", error="connection refused"))
    out.call(0, None, "fail", "{}")
    [call] = out.end_turn().calls
    out.mcp_result(call, None, "boom")
    out.end_turn()
    out.finish("completed")
    frames = out.take()

    types = [e["type"] for e in _events(frames)]

    assert "response.mcp_list_tools.failed" in types and "response.mcp_call.failed" in types
    final = _accumulated(frames)
    assert final.output[0].error == "connection refused"
    assert final.output[1].status == "failed"
    assert final.output[1].error.type == "mcp_tool_execution_error"
    assert final.output[1].error.content == [{"type": "text", "text": "boom"}]


def test_cancelling_closes_open_items_as_incomplete_without_a_final_event() -> None:
    out = ResponseBuilder(_response(), streaming=True, mcp_tools={"add": ("calc", "add")})
    out.start()
    out.call(0, None, "add", "{}")
    out.end_turn()  # the MCP call now runs...
    out.text("never")
    out.finish("cancelled")

    events = _events(out.take())

    assert out.response.status == "cancelled" and out.response.completed_at is not None
    assert [o.status for o in out.response.output] == ["incomplete", "incomplete"]
    assert events[-1]["type"] == "response.output_item.done"
    assert not any(e["type"].startswith("response.completed") for e in events)


def test_a_cut_short_answer_is_incomplete_with_its_reason() -> None:
    out = ResponseBuilder(_response(), streaming=True)
    out.start()
    out.text("Once upon")
    out.finish("incomplete", reason="max_output_tokens")

    events = _events(out.take())

    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"


def test_an_empty_answer_is_still_one_message_and_nothing_streams_when_not_asked() -> None:
    out = ResponseBuilder(_response(), streaming=False)
    out.start()
    out.end_turn()
    out.finish("completed")

    assert out.take() == []
    assert [(o.type, o.content[0].text) for o in out.response.output] == [("message", "")]  # type: ignore[union-attr]


# The store


def test_the_store_evicts_the_least_recently_used_finished_response_first() -> None:
    store = ResponseStore(capacity=2)
    running = StoredResponse(Response(id="a", model="m", status="in_progress"))
    done = StoredResponse(Response(id="b", model="m", status="completed"))
    store.add(running)
    store.add(done)

    store.add(StoredResponse(Response(id="c", model="m", status="completed")))

    assert store.get("a") is running and store.get("b") is None and store.get("c") is not None
    store.get("a")
    store.add(StoredResponse(Response(id="d", model="m", status="completed")))
    assert store.get("c") is None and len(store) == 2


def _entry(rid: str, status: str = "completed", **kw: Any) -> StoredResponse:
    return StoredResponse(Response(id=rid, model="m", status=status), **kw)  # type: ignore[arg-type]


ALICE, BOB = hashlib.sha256(b"sk-alice").digest(), hashlib.sha256(b"sk-bob").digest()


def test_a_response_is_found_only_with_the_key_that_made_it() -> None:
    store = ResponseStore()
    store.add(_entry("a", owner=ALICE))
    store.add(_entry("open"))

    assert store.get("a", ALICE) is not None
    assert store.get("a", BOB) is None and store.get("a") is None
    assert store.get("open") is not None and store.get("open", ALICE) is None


def test_a_finished_response_lives_ttl_seconds_from_its_end() -> None:
    # Who fills the store: any key holder (each sees only its own). The most it holds is
    # --max-stored-responses finished responses plus --max-background-responses running ones,
    # each kept at most --response-ttl seconds after it ended and made from one request body of
    # at most --max-body-size.
    now = [0.0]
    store = ResponseStore(ttl=60, clock=lambda: now[0])
    entry = _entry("a")
    store.add(entry)
    now[0] = 1000.0  # unfinished time does not count
    store.ended(entry)

    now[0] = 1059.0
    assert store.get("a") is entry
    now[0] = 1060.0
    assert store.get("a") is None and len(store) == 0


def test_expired_responses_are_dropped_when_others_are_added() -> None:
    now = [0.0]
    store = ResponseStore(ttl=60, clock=lambda: now[0])
    for rid in ("a", "b"):
        store.add(entry := _entry(rid))
        store.ended(entry)
    now[0] = 61.0

    store.add(_entry("c"))

    assert len(store) == 1


def test_a_running_background_response_is_never_evicted_nor_expired() -> None:
    # Evicting one would leave a run nobody can cancel; cancelling it on eviction would let any
    # client's burst of responses cancel another's. The caller bounds their number instead.
    now = [0.0]
    store = ResponseStore(capacity=2, ttl=1, clock=lambda: now[0])
    background = [_entry(f"bg{i}", "in_progress", scope=trio.CancelScope()) for i in range(3)]
    for entry in background:
        store.add(entry)
    store.add(_entry("fg", "in_progress"))
    now[0] = 100.0

    for i in range(10):
        store.add(_entry(f"done{i}"))

    assert all(store.get(e.response.id) is e for e in background)
    assert len(store) == 4  # capacity, plus the background runs past it
    background[0].response.status = "cancelled"
    background[0].done.set()
    store.ended(background[0])
    now[0] = 102.0
    assert store.get("bg0") is None


# MCP tools as the model sees them


def _offered(label: str, *names: str) -> tuple[Any, list[McpToolInfo]]:
    [(_, spec)] = mcp_tool_specs([{"type": "mcp", "server_label": label}])
    return spec, [McpToolInfo(name=n, input_schema={"type": "object"}) for n in names]


def test_mcp_tools_keep_their_names_unless_two_tools_share_one() -> None:
    from triode.edge.responses.plan import _mcp_functions
    from triode.edge.tools.choice import FunctionTool

    weather = FunctionTool(name="get_weather", description="", parameters={}, strict=False)
    offered = [_offered("a", "add", "echo"), _offered("b", "echo", "get_weather")]

    tools, routes, names = _mcp_functions([weather], offered)

    assert [t.name for t in tools] == ["get_weather", "add", "a__echo", "b__echo",
                                       "b__get_weather"]  # fmt: skip
    assert routes["a__echo"] == ("a", "echo", None) and routes["add"] == ("a", "add", None)
    assert names[("b", "get_weather")] == "b__get_weather"


def test_an_mcp_tool_choice_names_one_tool_or_requires_one_of_a_server() -> None:
    from triode.edge.responses.plan import _mcp_functions, _tool_choice

    tools, routes, names = _mcp_functions([], [_offered("a", "add"), _offered("b", "mul")])

    choice, forced = _tool_choice({"type": "mcp", "server_label": "b"}, tools, routes, names)
    assert choice.mode == "required" and [t.name for t in forced or ()] == ["mul"]
    choice, forced = _tool_choice(
        {"type": "mcp", "server_label": "a", "name": "add"}, tools, routes, names
    )
    assert (choice.mode, choice.name, forced) == ("named", "add", None)
    bad = [
        ({"type": "mcp", "server_label": "c"}, "tool_choice.server_label"),
        ({"type": "mcp", "server_label": "a", "name": "mul"}, "tool_choice.name"),
        ({"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice.type"),
    ]
    for raw, param in bad:
        assert _refused(_tool_choice, raw, tools, routes, names).param == param


def test_a_tool_choice_only_a_down_server_could_meet_is_no_choice() -> None:
    from triode.edge.responses.plan import _mcp_functions, _tool_choice

    tools, routes, names = _mcp_functions([], [_offered("down")])

    for raw in ("required", {"type": "mcp", "server_label": "down"}):
        choice, forced = _tool_choice(raw, tools, routes, names, {"down"})
        assert (choice.mode, forced) == ("none", None)
