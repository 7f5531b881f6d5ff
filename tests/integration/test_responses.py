"""`/v1/responses` on a real `triode serve` with the default model, driven by the openai client:
text, streams, the store, background runs and their cancelling, function tools, and MCP tools
on a real MCP server (plus one configured server that is down)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server import Server, free_port, running_server

from triode.edge.tools.mcp import ToolServers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mcp_server import running_mcp_server

pytestmark = pytest.mark.slow

MODEL = "m"
KEY, OTHER_KEY = "sk-responses", "sk-other-tenant"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_BACKGROUND = 2
TOOL_TIMEOUT = 1.0
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def mcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_mcp_server(tmp_path_factory.mktemp("mcp"), transport="sse") as s:
        yield s


@pytest.fixture(scope="module")
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/sse"


@pytest.fixture(scope="module")
def server(
    model_dir: Path, mcp: Any, dead_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("responses") / "serve.log"
    args = [
        "--served-model-name", MODEL, "--max-model-len", "2048",
        "--tool-server", f"{mcp.url},{dead_url}", "--tool-call-timeout", str(TOOL_TIMEOUT),
        "--max-tool-turns", "2", "--api-key", KEY, OTHER_KEY, "--metrics-require-key",
        "--max-background-responses", str(MAX_BACKGROUND),
    ]  # fmt: skip
    with running_server(args, log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def other(server: Server) -> openai.OpenAI:
    """A client with the server's other key: another tenant."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def labels(mcp: Any, dead_url: str) -> dict[str, str]:
    """The server labels of the live and the dead MCP server, as the server names them."""
    live, dead = ToolServers([mcp.url, dead_url]).labels()
    return {"live": live, "dead": dead}


def _mcp_tool(label: str, *allowed: str) -> dict[str, Any]:
    tool: dict[str, Any] = {"type": "mcp", "server_label": label, "require_approval": "never"}
    if allowed:
        tool["allowed_tools"] = list(allowed)
    return tool


def _metrics(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    found = re.findall(r"^(triode:[a-z_]+)(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    return {name: float(value) for name, value in found}


def _settle(server: Server, timeout: float = 20.0) -> dict[str, float]:
    """Wait for the engine to run nothing and hold no KV block."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if m["triode:num_requests_running"] == 0 and m["triode:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, f"the engine never settled: {m}"
        time.sleep(0.1)


QUESTION = "What is the capital of France? Answer in one short sentence."


def test_create_answers_with_text_and_usage(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)

    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    [message] = r.output
    assert message.type == "message" and message.content[0].type == "output_text"
    usage = r.usage
    assert usage is not None and 0 < usage.output_tokens <= 24 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"


def test_a_stream_builds_the_same_answer_as_create(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": QUESTION, "max_output_tokens": 24,
                            "temperature": 0, "instructions": "You are terse."}  # fmt: skip
    whole = client.responses.create(**body)

    with client.responses.stream(**body) as stream:
        events = list(stream)

    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in types and "response.output_text.done" in types
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers))
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


def test_a_stored_response_is_retrieved_and_continued(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="My name is Ada. Say hello to me.", max_output_tokens=12,
        temperature=0,
    )  # fmt: skip

    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text
    assert stored.status == first.status
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id,
        max_output_tokens=12, temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    # the first exchange is part of the second prompt
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_an_unstored_response_can_be_neither_retrieved_nor_continued(
    client: openai.OpenAI,
) -> None:
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)

    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=r.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_cancelled_background_response_frees_the_engine(
    client: openai.OpenAI, server: Server
) -> None:
    queued = client.responses.create(
        model=MODEL, input="Count from 1 to 500, one number per line:", max_output_tokens=1500,
        temperature=0, background=True,
    )  # fmt: skip
    assert queued.status in ("queued", "in_progress") and queued.background

    deadline = time.monotonic() + 15
    while True:
        progress = client.responses.retrieve(queued.id)
        if progress.status == "in_progress" and len(progress.output_text) > 20:
            break
        assert progress.status in ("queued", "in_progress"), progress.status
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.1)
    assert _metrics(server)["triode:num_requests_running"] == 1

    cancelled = client.responses.cancel(queued.id)

    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    _settle(server)


def test_a_disconnected_stream_frees_the_engine(server: Server) -> None:
    body = {"model": MODEL, "input": "Count from 1 to 500, one number per line:",
            "max_output_tokens": 1500, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json=body, headers=AUTH, timeout=30
    ) as response:
        seen = b""
        for chunk in response.iter_bytes():
            seen += chunk
            if seen.count(b"response.output_text.delta") >= 3:
                break

    _settle(server)


def test_a_named_function_tool_is_called_and_its_output_continues(
    client: openai.OpenAI,
) -> None:
    r = client.responses.create(
        model=MODEL, input="What is the weather like in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48,
        temperature=0,
    )  # fmt: skip

    assert r.status == "completed"
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    arguments = json.loads(call.arguments)  # the schema: {"city": <a string>}, nothing else
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    after = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=24,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature_c": 21, "sky": "clear"})}],
        tool_choice="none", temperature=0,
    )  # fmt: skip
    assert after.status in ("completed", "incomplete") and after.output_text
    assert not [o for o in after.output if o.type == "function_call"]


def test_a_required_mcp_tool_is_called_and_the_model_answers(
    client: openai.OpenAI, mcp: Any, labels: dict[str, str]
) -> None:
    r = client.responses.create(
        model=MODEL, input="What is 2 + 3? Use the add tool.",
        tools=[_mcp_tool(labels["live"], "add")], tool_choice="required",
        max_output_tokens=200, temperature=0,
    )  # fmt: skip

    kinds = [o.type for o in r.output]
    assert kinds[:2] == ["mcp_list_tools", "mcp_call"] and kinds[-1] == "message"
    listing, call = r.output[0], r.output[1]
    assert [t.name for t in listing.tools] == ["add"] and listing.error is None  # type: ignore[union-attr]
    assert call.name == "add" and call.server_label == labels["live"]  # type: ignore[union-attr]
    arguments = json.loads(call.arguments)  # type: ignore[union-attr]
    assert call.error is None and call.output is not None  # type: ignore[union-attr]
    assert float(call.output) == arguments["a"] + arguments["b"]  # type: ignore[union-attr]
    assert any(c["tool"] == "add" and c["arguments"] == arguments for c in mcp.calls())
    assert r.output_text and r.status in ("completed", "incomplete")


def test_mcp_events_stream_in_order(client: openai.OpenAI, labels: dict[str, str]) -> None:
    with client.responses.stream(
        model=MODEL, input="Add 4 and 5.", tools=[_mcp_tool(labels["live"], "add")],
        tool_choice="required", max_output_tokens=200, temperature=0,
    ) as stream:  # fmt: skip
        types = [e.type for e in stream]

    mcp_types = [t for t in types if ".mcp_" in t]
    assert mcp_types[:2] == ["response.mcp_list_tools.in_progress",
                             "response.mcp_list_tools.completed"]  # fmt: skip
    assert mcp_types[-2:] == ["response.mcp_call.in_progress", "response.mcp_call.completed"]
    assert types[-1] in ("response.completed", "response.incomplete")


def test_a_down_slow_or_failing_tool_is_an_error_item_not_a_failure(
    client: openai.OpenAI, labels: dict[str, str]
) -> None:
    down = client.responses.create(
        model=MODEL, input="Hi", tools=[_mcp_tool(labels["dead"])], tool_choice="required",
        max_output_tokens=8,
    )  # fmt: skip
    [listing] = [o for o in down.output if o.type == "mcp_list_tools"]
    assert listing.error and not listing.tools
    assert down.output[-1].type == "message"

    failed = client.responses.create(
        model=MODEL, input="Call fail with the message 'boom'.",
        tools=[_mcp_tool(labels["live"], "fail")],
        tool_choice={"type": "mcp", "server_label": labels["live"], "name": "fail"},
        max_output_tokens=32, temperature=0,
    )  # fmt: skip
    [call] = [o for o in failed.output if o.type == "mcp_call"]
    assert call.status == "failed" and call.error is not None

    started = time.monotonic()
    slow = client.responses.create(
        model=MODEL, input="Call slow with seconds set to 30.",
        tools=[_mcp_tool(labels["live"], "slow")],
        tool_choice={"type": "mcp", "server_label": labels["live"], "name": "slow"},
        max_output_tokens=32, temperature=0,
    )  # fmt: skip
    [call] = [o for o in slow.output if o.type == "mcp_call"]
    seconds = json.loads(call.arguments)["seconds"]
    if seconds > TOOL_TIMEOUT * 2:
        assert call.status == "failed" and call.error is not None
        assert time.monotonic() - started < seconds


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "text": {"format": {"type": "text"}, "colour": 1}}, "text.colour"),
        ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "mcp", "server_label": "x",
                                   "require_approval": "always"}]},
         "tools[0].require_approval"),
        ({"input": "x", "tools": [{"type": "mcp", "server_label": "elsewhere",
                                   "server_url": "http://127.0.0.1:9/sse"}]},
         "tools[0].server_url"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]},
         "input[0].call_id"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                            "schema": {"type": "nonsense"}}}}, "text.format"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
         "tool_choice.name"),
    ],
)  # fmt: skip
def test_bad_inputs_are_400s_naming_the_field(
    server: Server, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        f"{server.url}/v1/responses", json={"model": MODEL, **body}, headers=AUTH, timeout=30
    )

    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_unknown_ids_are_404s_and_only_background_responses_cancel(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)


def test_the_response_routes_answer_their_methods_only(server: Server) -> None:
    one = f"{server.url}/v1/responses/resp_x"

    wrong = httpx.post(one, json={}, headers=AUTH, timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "DELETE, GET, OPTIONS"
    assert httpx.get(f"{one}/cancel", headers=AUTH, timeout=10).status_code == 405
    assert httpx.get(f"{one}/cancel/more", headers=AUTH, timeout=10).status_code == 404
    assert httpx.delete(one, headers=AUTH, timeout=10).status_code == 404


# Tenants and bounds


def test_a_response_is_invisible_to_another_key(
    client: openai.OpenAI, other: openai.OpenAI
) -> None:
    mine = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)

    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as caught:
        other.responses.create(model=MODEL, input="Hi", previous_response_id=mine.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id


def test_background_responses_past_the_cap_are_429s(
    client: openai.OpenAI, other: openai.OpenAI, server: Server
) -> None:
    # Who can start one: any key holder; what the largest costs: a run of up to max_model_len
    # tokens that outlives its request. So at most MAX_BACKGROUND run at once, over all keys.
    body = {"model": MODEL, "input": "Count from 1 to 500, one number per line:",
            "max_output_tokens": 1500, "temperature": 0, "background": True}  # fmt: skip
    running = [client.responses.create(**body), other.responses.create(**body)]
    try:
        refused = httpx.post(f"{server.url}/v1/responses", json=body, headers=AUTH, timeout=30)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["message"].startswith("background:")
    finally:
        client.responses.cancel(running[0].id)
        other.responses.cancel(running[1].id)
    _settle(server)
    again = client.responses.create(**{**body, "max_output_tokens": 2})
    client.responses.cancel(again.id)


def test_metrics_need_the_key_under_metrics_require_key(server: Server) -> None:
    refused = httpx.get(f"{server.url}/metrics", timeout=10)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).status_code == 200
