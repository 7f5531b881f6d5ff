"""Tool calling at the edge: reading `tools` and `tool_choice`, writing tools into prompts, the
grammar that forces a call, and reading calls back out of answers, whole and streamed."""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path
from typing import Any

import llguidance
import pytest

from triode.actors.chat_template import ChatTemplate
from triode.actors.grammar import check_grammar
from triode.edge.errors import APIError
from triode.edge.tools.calls import (
    ContentDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    call_grammar,
    parse_tool_calls,
)
from triode.edge.tools.choice import (
    FunctionTool,
    ToolChoice,
    check_tool_messages,
    parse_tool_choice,
    parse_tools,
    prepare_messages,
    template_renders_tools,
)
from triode.wire import StructuredOutputsParams

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
RAW_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "now"}},
]
TOOLS = parse_tools(RAW_TOOLS)
AUTO = ToolChoice("auto")


def _call(name: str, arguments: dict[str, Any]) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def _rejects(param: str, fn: Any, /, *args: Any, **kwargs: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        fn(*args, **kwargs)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert caught.value.message.startswith(f"{param}: ")
    return caught.value


# parse_tools


def test_tools_are_read_from_the_chat_format() -> None:
    assert TOOLS == [
        FunctionTool("get_weather", "Weather now", WEATHER),
        FunctionTool("now"),
    ]


def test_flat_tools_skip_entries_of_other_types() -> None:
    raw = [
        {"type": "web_search"},
        {"type": "function", "name": "now", "strict": True},
        {"type": "function", "name": "bad name"},
    ]
    _rejects("tools[2].name", parse_tools, raw, flat=True)
    assert parse_tools(raw[:2], flat=True) == [FunctionTool("now", strict=True)]
    assert parse_tools(raw[:2], param="input.tools", flat=True)[0].name == "now"


def _fn(**function: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", **function}}]


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"type": "function"}, "tools"),
        ("get_weather", "tools"),
        (["x"], "tools[0]"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
        ([{"function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": "f"}], "tools[0].function"),
        ([{"type": "function", "function": {}}], "tools[0].function.name"),
        (_fn(name=7), "tools[0].function.name"),
        (_fn(name=""), "tools[0].function.name"),
        (_fn(name="get weather"), "tools[0].function.name"),
        (_fn(name="f" * 65), "tools[0].function.name"),
        (_fn(name="ünï"), "tools[0].function.name"),
        ([*RAW_TOOLS, RAW_TOOLS[1]], "tools[2].function.name"),
        (_fn(description=3), "tools[0].function.description"),
        (_fn(parameters="{}"), "tools[0].function.parameters"),
        (_fn(parameters=[]), "tools[0].function.parameters"),
        (_fn(parameters={"type": "string"}), "tools[0].function.parameters"),
        (_fn(parameters={"type": "object", "properties": {"a": {"type": "nosuch"}}}),
         "tools[0].function.parameters"),
        (_fn(parameters={"$ref": "#/$defs/missing"}), "tools[0].function.parameters"),
        (_fn(parameters={"type": "object", "required": ["a"],
                         "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 1}}}),
         "tools[0].function.parameters"),
        (_fn(strict="yes"), "tools[0].function.strict"),
    ],
)  # fmt: skip
def test_malformed_tools_are_a_400_naming_the_field(raw: Any, param: str) -> None:
    _rejects(param, parse_tools, raw)


def test_a_schema_that_does_not_compile_says_why() -> None:
    bad = _fn(parameters={"type": "object", "properties": {"a": {"type": "nosuch"}}})
    assert "nosuch" in _rejects("tools[0].function.parameters", parse_tools, bad).message


def test_the_param_prefix_is_the_callers() -> None:
    _rejects("input.tools[0].name", parse_tools, [{"type": "function"}], param="input.tools",
             flat=True)  # fmt: skip


# parse_tool_choice


@pytest.mark.parametrize(
    ("raw", "tools", "expected"),
    [
        (None, TOOLS, ToolChoice("auto")),
        (None, [], ToolChoice("none")),
        ("none", TOOLS, ToolChoice("none")),
        ("auto", TOOLS, ToolChoice("auto")),
        ("auto", [], ToolChoice("auto")),
        ("required", TOOLS, ToolChoice("required")),
        ({"type": "function", "function": {"name": "now"}}, TOOLS, ToolChoice("named", "now")),
    ],
)
def test_tool_choices(raw: Any, tools: list[FunctionTool], expected: ToolChoice) -> None:
    assert parse_tool_choice(raw, tools) == expected


def test_a_flat_tool_choice_names_the_function_at_its_top() -> None:
    raw = {"type": "function", "name": "now"}
    assert parse_tool_choice(raw, TOOLS, flat=True) == ToolChoice("named", "now")


@pytest.mark.parametrize(
    ("raw", "tools", "flat", "param"),
    [
        ("required", [], False, "tool_choice"),
        ("always", TOOLS, False, "tool_choice"),
        (3, TOOLS, False, "tool_choice"),
        ({"type": "allowed_tools"}, TOOLS, False, "tool_choice"),
        ({"type": "function"}, TOOLS, False, "tool_choice.function"),
        ({"type": "function", "function": {}}, TOOLS, False, "tool_choice.function.name"),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS, False,
         "tool_choice.function.name"),
        ({"type": "function", "function": {"name": "now"}}, [], False,
         "tool_choice.function.name"),
        ({"type": "function", "name": "nope"}, TOOLS, True, "tool_choice.name"),
        ({"type": "function", "function": {"name": "now"}}, TOOLS, True, "tool_choice.name"),
    ],
)  # fmt: skip
def test_bad_tool_choices_are_a_400(
    raw: Any, tools: list[FunctionTool], flat: bool, param: str
) -> None:
    _rejects(param, parse_tool_choice, raw, tools, flat=flat)


# check_tool_messages


def _assistant_call(call_id: str = "call_1", **call: Any) -> dict[str, Any]:
    entry = {
        "id": call_id,
        "type": "function",
        "function": {"name": "now", "arguments": "{}"},
        **call,
    }
    return {"role": "assistant", "content": None, "tool_calls": [entry], "tool_call_id": None}


def _result(call_id: str | None, content: str = "12:00") -> dict[str, Any]:
    return {"role": "tool", "content": content, "tool_calls": None, "tool_call_id": call_id}


USER = {"role": "user", "content": "What time is it?", "tool_calls": None, "tool_call_id": None}


def test_a_conversation_with_calls_and_results_passes() -> None:
    check_tool_messages([USER, _assistant_call(), _result("call_1"), USER])


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([USER, _result(None)], "messages[1].tool_call_id"),
        ([USER, _result("")], "messages[1].tool_call_id"),
        ([USER, _result("call_9")], "messages[1].tool_call_id"),
        ([USER, _assistant_call(), _result("call_2")], "messages[2].tool_call_id"),
        ([_result("call_1"), _assistant_call()], "messages[0].tool_call_id"),
        ([{**USER, "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": "now"}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": ["now"]}], "messages[0].tool_calls[0]"),
        ([_assistant_call(None)], "messages[0].tool_calls[0].id"),
        ([_assistant_call(type="tool")], "messages[0].tool_calls[0].type"),
        ([_assistant_call(type=None)], "messages[0].tool_calls[0].type"),
        ([_assistant_call(function=None)], "messages[0].tool_calls[0].function"),
        ([_assistant_call(function={"arguments": "{}"})],
         "messages[0].tool_calls[0].function.name"),
        ([_assistant_call(function={"name": "now"})],
         "messages[0].tool_calls[0].function.arguments"),
        ([_assistant_call(function={"name": "now", "arguments": {}})],
         "messages[0].tool_calls[0].function.arguments"),
    ],
)  # fmt: skip
def test_bad_tool_messages_are_a_400(messages: list[dict[str, Any]], param: str) -> None:
    _rejects(param, check_tool_messages, messages)


# Prompts


@functools.cache
def _model_dir() -> Path | None:
    from triode.gpu.loader import resolve_model

    try:
        return resolve_model(None)
    except FileNotFoundError:
        return None


@pytest.fixture
def model_dir() -> Path:
    path = _model_dir()
    if path is None:
        pytest.skip("the default model is not fetched; run `make model`")
    return path


HERMES_LIKE = (
    "{% if tools %}{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


@pytest.mark.parametrize(
    ("source", "renders"),
    [
        (HERMES_LIKE, True),
        ("{% if tools is defined and tools %}x{% endif %}", True),
        ("{%- set t = tools -%}", True),
        ("{{ messages[0].tools }}{{ 'tools' }} tools", False),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
        ("{% if %}", False),
    ],
)
def test_a_template_renders_tools_when_it_reads_the_variable(source: str, renders: bool) -> None:
    assert template_renders_tools(source) is renders


def test_the_default_model_template_does_not_render_tools(model_dir: Path) -> None:
    assert not template_renders_tools(ChatTemplate.from_model_dir(model_dir).source)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    USER,
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    _result("call_1", '{"temperature": 21}'),
    {"role": "tool", "content": [{"type": "text", "text": "12:00"}], "tool_call_id": "call_2"},
    USER,
]


def test_tools_are_described_in_the_first_system_message() -> None:
    messages, kwargs = prepare_messages(CONVERSATION, TOOLS, AUTO, renders_tools=False)
    assert kwargs == {}
    system = messages[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n# Tools")
    for tool in RAW_TOOLS:
        assert json.dumps(tool["function"]["name"]) in system["content"]
    assert json.dumps(WEATHER) in system["content"]
    assert (
        '<tool_call>\n{"name": "<function name>", "arguments": {...}}\n</tool_call>'
        in (system["content"])
    )


def test_without_a_system_message_one_is_added_first() -> None:
    messages, _ = prepare_messages([USER], TOOLS, ToolChoice("named", "now"), renders_tools=False)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "Answer by calling the function now." in messages[0]["content"]
    assert messages[1] is USER


def test_calls_and_results_are_written_in_the_call_format() -> None:
    messages, _ = prepare_messages(CONVERSATION, TOOLS, AUTO, renders_tools=False)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "user"]
    assistant = messages[2]
    assert "tool_calls" not in assistant
    assert assistant["content"] == "\n".join(
        ["Let me check.", _call("get_weather", {"city": "Zürich"}), _call("now", {})]
    )
    assert messages[3]["content"] == (
        '<tool_response>\n{"temperature": 21}\n</tool_response>\n'
        "<tool_response>\n12:00\n</tool_response>"
    )


def test_choice_none_describes_no_tools_but_keeps_the_history_readable() -> None:
    messages, kwargs = prepare_messages(
        CONVERSATION, TOOLS, ToolChoice("none"), renders_tools=False
    )
    assert kwargs == {}
    assert messages[0] == CONVERSATION[0]
    assert messages[2]["content"].startswith("Let me check.\n<tool_call>")
    assert messages[3]["role"] == "user"


def test_a_template_that_renders_tools_gets_them_and_argument_objects() -> None:
    messages, kwargs = prepare_messages(CONVERSATION, TOOLS, AUTO, renders_tools=True)
    assert kwargs["tools"][0] == RAW_TOOLS[0]
    assert kwargs["tools"][1]["function"] == {
        "name": "now",
        "parameters": {"type": "object", "properties": {}},
    }
    call = messages[2]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Zürich"}}
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'
    assert messages[3] == CONVERSATION[3]
    text = ChatTemplate(HERMES_LIKE).render(messages, **kwargs)
    assert text.startswith(json.dumps(RAW_TOOLS[0]))
    _, none = prepare_messages(CONVERSATION, TOOLS, ToolChoice("none"), renders_tools=True)
    assert none == {}


def test_the_default_model_prompt_describes_the_tools(model_dir: Path) -> None:
    template = ChatTemplate.from_model_dir(model_dir)
    messages, kwargs = prepare_messages([USER], TOOLS, AUTO, renders_tools=False)
    prompt = template.render(messages, **kwargs)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(RAW_TOOLS[0]) in prompt
    assert '<tool_call>\n{"name": "<function name>", "arguments": {...}}\n</tool_call>' in prompt
    assert prompt.endswith("What time is it?<|im_end|>\n<|im_start|>assistant\n")


def test_the_default_model_renders_a_whole_tool_conversation(model_dir: Path) -> None:
    template = ChatTemplate.from_model_dir(model_dir)
    check_tool_messages(CONVERSATION)
    messages, kwargs = prepare_messages(CONVERSATION, TOOLS, AUTO, renders_tools=False)
    prompt = template.render(messages, **kwargs)
    assert "<|im_start|>tool" not in prompt
    assert (
        "<|im_start|>assistant\nLet me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
    ) in prompt
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" not in prompt
    assert "</tool_response>\n<tool_response>\n12:00\n</tool_response><|im_end|>" in prompt
    assert prompt.count("<|im_start|>") == 6


# Grammars


@functools.cache
def _tokenizer(model_dir: Path) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=49152)


def _accepts(model_dir: Path, grammar: str, text: str) -> bool:
    tokenizer = _tokenizer(model_dir)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar),
                                   log_level=0)  # fmt: skip
    tokens = tokenizer.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and (
        matcher.consume_tokens(tokens) and matcher.is_accepting()
    )


def test_auto_and_none_leave_the_answer_free() -> None:
    assert call_grammar(TOOLS, AUTO, parallel=True) is None
    assert call_grammar(TOOLS, ToolChoice("none"), parallel=True) is None


@pytest.mark.parametrize(
    "choice", [ToolChoice("required"), ToolChoice("named", "get_weather")], ids=str
)
@pytest.mark.parametrize("parallel", [False, True])
def test_call_grammars_compile_where_the_engine_compiles_them(
    choice: ToolChoice, parallel: bool
) -> None:
    grammar = call_grammar(TOOLS, choice, parallel=parallel)
    assert grammar is not None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(grammar), None
    )
    assert (failed, messages) == (False, [])
    check_grammar(StructuredOutputsParams(grammar=grammar))


WEATHER_CALL = _call("get_weather", {"city": "Paris", "days": 2})


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        (WEATHER_CALL, True),
        (_call("get_weather", {"city": "Zürich"}), True),
        (_call("now", {}), True),
        (_call("now", {"any": ["thing", 1]}), True),
        (_call("get_time", {}), False),
        (_call("get_weather", {"city": 3}), False),
        (_call("get_weather", {"city": "Paris", "days": "two"}), False),
        (_call("get_weather", {"days": 2}), False),
        ("Sure! " + WEATHER_CALL, False),
        (" " + WEATHER_CALL, False),
        (WEATHER_CALL + "\nDone.", False),
        (WEATHER_CALL.replace('", "', '","'), False),
        (WEATHER_CALL.replace("\n", "\n\n"), False),
        (WEATHER_CALL.replace("<tool_call>\n", "<tool_call>"), False),
        ('<tool_call>\n{"name": "get_weather", "arguments": "{}"}\n</tool_call>', False),
        ("", False),
    ],
)
def test_a_required_call_is_forced_into_the_format(
    model_dir: Path, text: str, accepted: bool
) -> None:
    grammar = call_grammar(TOOLS, ToolChoice("required"), parallel=False)
    assert grammar is not None
    assert _accepts(model_dir, grammar, text) is accepted


def test_parallel_calls_are_blocks_one_per_line(model_dir: Path) -> None:
    two = WEATHER_CALL + "\n" + _call("now", {})
    parallel = call_grammar(TOOLS, ToolChoice("required"), parallel=True)
    single = call_grammar(TOOLS, ToolChoice("required"), parallel=False)
    assert parallel is not None and single is not None
    assert _accepts(model_dir, parallel, WEATHER_CALL)
    assert _accepts(model_dir, parallel, two)
    assert not _accepts(model_dir, parallel, two.replace("\n<tool_call>", "\n\n<tool_call>"))
    assert not _accepts(model_dir, single, two)


def test_a_named_choice_allows_that_function_only(model_dir: Path) -> None:
    grammar = call_grammar(TOOLS, ToolChoice("named", "now"), parallel=True)
    assert grammar is not None
    assert _accepts(model_dir, grammar, _call("now", {}))
    assert not _accepts(model_dir, grammar, WEATHER_CALL)
    assert not _accepts(model_dir, grammar, _call("now", {}) + "\n" + _call("now", {}))


def test_a_schema_with_gbnf_markers_and_braces_in_its_text_still_compiles(
    model_dir: Path,
) -> None:
    schema = {
        "type": "object",
        "description": 'a } brace, a { brace, "quotes" and ::= too',
        "properties": {"rule::=": {"enum": ["a ::= b"]}},
        "required": ["rule::="],
    }
    tools = parse_tools(_fn(parameters=schema))
    grammar = call_grammar(tools, ToolChoice("required"), parallel=False)
    assert grammar is not None and "::=" not in grammar
    check_grammar(StructuredOutputsParams(grammar=grammar))
    assert _accepts(model_dir, grammar, _call("f", {"rule::=": "a ::= b"}))
    assert not _accepts(model_dir, grammar, _call("f", {"rule::=": "a = b"}))


def test_what_the_grammar_accepts_parses_back_into_the_call(model_dir: Path) -> None:
    two = WEATHER_CALL + "\n" + _call("now", {})
    grammar = call_grammar(TOOLS, ToolChoice("required"), parallel=True)
    assert grammar is not None and _accepts(model_dir, grammar, two)
    content, calls = parse_tool_calls(two, TOOLS)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "days": 2}'),
        ("now", "{}"),
    ]


# Answers


def _plain(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("", "", []),
        ("  Just text.\n", "Just text.", []),
        (WEATHER_CALL, "", [("get_weather", '{"city": "Paris", "days": 2}')]),
        ("Checking.\n" + _call("now", {}) + "\n" + _call("now", {"tz": "UTC"}) + "\nDone.",
         "Checking.\n\n\nDone.", [("now", "{}"), ("now", '{"tz": "UTC"}')]),
        ('<tool_call>{"name":"now","arguments":{"tz" :"Europe/Zürich"}}</tool_call>', "",
         [("now", '{"tz": "Europe/Zürich"}')]),
        ('<tool_call>\n{"name": "now", "arguments": {"tz": "\\u00e9"}}', "",
         [("now", '{"tz": "é"}')]),
        ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_', "", [("now", "{}")]),
        ('<tool_call>{"name": "now", "arguments": {"s": "</tool_call>"}}</tool_call>', "",
         [("now", '{"s": "</tool_call>"}')]),
        ("I use <tool_call> tags.", "I use <tool_call> tags.", []),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
        ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>',
         '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', []),
        ('<tool_call>{"name": "now"}</tool_call>', '<tool_call>{"name": "now"}</tool_call>', []),
        ('<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',
         '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>', []),
        ('<tool_call>{"name": "now", "arguments": {}} extra</tool_call>',
         '<tool_call>{"name": "now", "arguments": {}} extra</tool_call>', []),
        ('<tool_call>{"name": "now", "arguments": {', '<tool_call>{"name": "now", "arguments": {',
         []),
        ("<tool_call>oops<tool_call>" + _call("now", {})[len("<tool_call>"):],
         "<tool_call>oops", [("now", "{}")]),
        ("a <tool_ca", "a <tool_ca", []),
    ],
)  # fmt: skip
def test_calls_are_read_out_of_an_answer(
    text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    got_content, got_calls = parse_tool_calls(text, TOOLS)
    assert (got_content, _plain(got_calls)) == (content, calls)


def test_each_call_gets_a_fresh_id() -> None:
    _, calls = parse_tool_calls(_call("now", {}) + _call("now", {"tz": "UTC"}), TOOLS)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id


def test_a_repeated_call_ends_the_answer() -> None:
    paris, rome = _call("get_weather", {"city": "Paris"}), _call("get_weather", {"city": "Rome"})
    text = "Checking.\n" + paris + "\n" + rome + "\n" + paris + "\nAnd more " + rome
    content, calls = parse_tool_calls(text, TOOLS)
    assert (content, _plain(calls)) == ("Checking.", [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}'),
    ])  # fmt: skip
    stream = ToolCallStream(TOOLS)
    assert len(stream.feed(paris + "\n")) == 2 and not stream.ended
    # the same arguments written with other spacing are the same call
    assert stream.feed(paris.replace(": ", ":") + "more") == [] and stream.ended
    assert stream.feed(rome) == [] and stream.finish() == []


def test_the_stream_passes_content_on_at_once_and_holds_a_possible_tag() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Hello") == [ContentDelta("Hello")]
    assert stream.feed(" wor") == [ContentDelta(" wor")]
    assert stream.feed("ld <tool") == [ContentDelta("ld")]
    assert stream.feed("_call>\n") == []
    assert stream.feed('{"name": "now", "arguments": {"a"') == []
    events = stream.feed(": 1}}\n</tool_call>")
    assert len(events) == 2
    head, arguments = events
    assert isinstance(head, ToolCallDelta) and head.id is not None
    assert (head.index, head.name, head.arguments) == (0, "now", "")
    assert arguments == ToolCallDelta(0, None, None, '{"a": 1}')
    assert stream.feed(" <tool_call>nope") == [ContentDelta("  <tool_call>nope")]
    assert stream.feed("  ") == []
    assert stream.finish() == []


def test_an_invalid_block_is_content_once_it_is_known_to_be() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed('<tool_call>\n{"name": "get_weather", "arguments": ') == []
    assert stream.feed('"Paris"}</tool_call>') == [
        ContentDelta('<tool_call>\n{"name": "get_weather", "arguments": "Paris"}</tool_call>')
    ]
    assert stream.feed('<tool_call>{"name": "now", "arguments": {') == []
    assert stream.finish() == [ContentDelta('<tool_call>{"name": "now", "arguments": {')]


SAMPLES = [
    "Plain answer, no calls at all.",
    "  \n" + WEATHER_CALL + "\n",
    "Let me look.\n" + WEATHER_CALL + "\n" + _call("now", {"tz": "Europe/Zürich"}) + "\nOK.",
    "<tool<tool_call> x </tool_call> <tool_call>\n"
    + json.dumps({"name": "now", "arguments": {"s": '}</tool_call>{\\"\n'}})
    + "\n</tool_call>trailing <tool_",
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call> and then '
    + _call("now", {"nested": {"a": [1, {"b": None}], "c": "[{"}})
    + ' <tool_call>\n{"name": "now", "arguments": {}}',
    "<tool_call>oops<tool_call>" + _call("now", {})[len("<tool_call>") :] + "</tool_call>",
    "a < b and c <<tool_call>\n"
    + '{"name":"get_weather",  "arguments":{"city":"Rome"}}   \n  </tool_call>',
    '<tool_call>\n{"name": "now", "arguments": {"x": "unterminated\n"}}\n</tool_call> tail',
    "Twice: " + WEATHER_CALL + " " + _call("now", {}) + WEATHER_CALL + " and text " + WEATHER_CALL,
]


def _joined(events: list[Any]) -> tuple[str, list[tuple[str, str]]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                assert e.index == len(calls) and e.name is not None and e.arguments == ""
                calls.append([e.name, ""])
            else:
                assert e.name is None
                calls[e.index][1] += e.arguments
    return content, [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize("text", SAMPLES)
def test_the_stream_agrees_with_the_whole_answer_however_it_is_split(text: str) -> None:
    content, calls = parse_tool_calls(text, TOOLS)
    expected = (content, _plain(calls))
    rng = random.Random(text)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ToolCallStream(TOOLS)
        events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
        assert _joined(events) == expected
    stream = ToolCallStream(TOOLS)
    one_by_one = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert _joined(one_by_one) == expected
