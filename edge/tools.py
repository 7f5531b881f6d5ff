"""Tool calling for chat completions: the request's `tools` and `tool_choice`, the prompt that
describes them, the grammar that forces a call, and the calls read back out of the model's text.

The format
----------
A chat template that renders `tools` itself gets them as its template expects. For any other
template triode describes the tools in the system message (each function as a line of JSON in
the chat format, then how to call one), and the model calls a function by writing a block:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, one block after another (a newline between them) for parallel calls. Earlier
calls in the conversation are written back into the assistant's text the same way, and each tool
result reaches the model as a user message:

    <tool_response>
    {"temperature": 21}
    </tool_response>

(consecutive results share one user message, one block each). This is the format of Hermes and
Qwen models' own templates, and it is the only one read back: in an answer, each block holding a
JSON object with the name of an offered function and an object of `arguments` is a call, and
everything outside the calls is the message content. A block that is not such a call stays in the
content as text; so does an unclosed one, unless it ends the answer after a complete call. A call
that repeats an earlier one of the same answer (same function, same arguments) ends the answer:
it and everything after it are dropped, and the server stops the generation there, since a model
that starts repeating itself would otherwise call the same function until `max_tokens`. With
`tool_choice` "required" or a named function, decoding is constrained to such blocks, the
arguments match the function's JSON schema, and JSON is written as `json.dumps` writes it.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Literal, NoReturn

import jinja2
import llguidance
import msgspec

from .errors import APIError

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The separators of json.dumps, which the prompt's calls use too, and no other whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_PARAMETERS = {"type": "object", "properties": {}}
_lexer = jinja2.Environment()


class FunctionTool(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the JSON schema of the arguments
    strict: bool | None = None


class ToolChoice(msgspec.Struct):
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the function a "named" choice calls


class ToolCall(msgspec.Struct):
    id: str
    name: str
    arguments: str  # the arguments object as compact JSON text


class ContentDelta(msgspec.Struct, frozen=True):
    """Text of the message content."""

    text: str


class ToolCallDelta(msgspec.Struct, frozen=True):
    """Part of call `index`: its id and name (with empty `arguments`), then its arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


StreamEvent = ContentDelta | ToolCallDelta


# Requests


def parse_tools(raw: Any, *, param: str = "tools", flat: bool = False) -> list[FunctionTool]:
    """The functions a request offers, in the chat format (`{"type": "function", "function":
    {...}}`) or, with `flat`, the Responses API's (`{"type": "function", "name": ...}`, where
    entries of other types are skipped). A 400 naming the entry for a malformed or duplicate
    one, and for parameters that are not an object schema or do not compile."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        _fail(param, "must be a list of tools")
    tools: list[FunctionTool] = []
    for i, entry in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(entry, dict):
            _fail(where, "must be an object")
        if flat:
            if entry.get("type") != "function":
                continue
            spec = entry
        else:
            if entry.get("type") != "function":
                _fail(f"{where}.type", f"must be 'function', not {entry.get('type')!r}")
            spec, where = entry.get("function"), f"{where}.function"
            if not isinstance(spec, dict):
                _fail(where, "required, an object with the function's name")
        tool = _tool(spec, where)
        if any(t.name == tool.name for t in tools):
            _fail(f"{where}.name", f"two tools are named {tool.name!r}")
        tools.append(tool)
    return tools


def parse_tool_choice(
    raw: Any, tools: list[FunctionTool], *, param: str = "tool_choice", flat: bool = False
) -> ToolChoice:
    """`tool_choice`: "none", "auto", "required" or `{"type": "function", "function": {"name":
    ...}}` (with `flat`, `{"type": "function", "name": ...}`); unset, "auto" when there are
    tools. A 400 for anything else, and for a choice that needs tools the request lacks."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("none", "auto", "required"):
        if raw == "required" and not tools:
            _fail(param, "'required' needs tools to call")
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function":
        if flat:
            name, where = raw.get("name"), f"{param}.name"
        else:
            function = raw.get("function")
            if not isinstance(function, dict):
                _fail(f"{param}.function", "required, an object with the function's name")
            name, where = function.get("name"), f"{param}.function.name"
        if not isinstance(name, str):
            _fail(where, "required, a string")
        if all(t.name != name for t in tools):
            _fail(where, f"no tool is named {name!r}")
        return ToolChoice("named", name)
    _fail(param, "must be 'none', 'auto', 'required' or a function to call")


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """A 400 for a malformed assistant tool call, and for a tool message that does not answer an
    earlier call by its id."""
    ids: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        calls = message.get("tool_calls")
        if calls is not None:
            if message.get("role") != "assistant":
                _fail(f"{where}.tool_calls", "only assistant messages make tool calls")
            if not isinstance(calls, list):
                _fail(f"{where}.tool_calls", "must be a list")
            for j, call in enumerate(calls):
                ids.add(_check_call(call, f"{where}.tool_calls[{j}]"))
        if message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                _fail(f"{where}.tool_call_id", "a tool message needs the id of its call")
            if call_id not in ids:
                _fail(f"{where}.tool_call_id", f"no earlier tool call has the id {call_id!r}")


def _tool(spec: dict[str, Any], where: str) -> FunctionTool:
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        _fail(f"{where}.name", "required, 1 to 64 letters, digits, underscores or dashes")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        _fail(f"{where}.description", "must be a string")
    parameters = spec.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            _fail(f"{where}.parameters", "must be a JSON schema (an object)")
        if parameters.get("type", "object") != "object":
            _fail(f"{where}.parameters", "must describe an object: its type must be 'object'")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        _fail(f"{where}.strict", "must be a boolean")
    tool = FunctionTool(name, description, parameters, strict)
    grammar = llguidance.LLMatcher.grammar_from_lark(_lark([tool], many=False))
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if failed:
        _fail(f"{where}.parameters", messages[0] if messages else "the schema does not compile")
    return tool


def _check_call(call: Any, where: str) -> str:
    if not isinstance(call, dict):
        _fail(where, "must be an object")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        _fail(f"{where}.id", "required, a string")
    if call.get("type") != "function":
        _fail(f"{where}.type", f"must be 'function', not {call.get('type')!r}")
    function = call.get("function")
    if not isinstance(function, dict):
        _fail(f"{where}.function", "required, an object with a name and arguments")
    if not isinstance(function.get("name"), str) or not function["name"]:
        _fail(f"{where}.function.name", "required, a string")
    if not isinstance(function.get("arguments"), str):
        _fail(f"{where}.function.arguments", "required, the arguments as JSON text")
    return call_id


def _fail(param: str, why: str) -> NoReturn:
    raise APIError(400, f"{param}: {why}", param=param)


# Prompts


def template_renders_tools(template_source: str) -> bool:
    """Whether a chat template reads the `tools` variable (and so describes tools itself)."""
    try:
        tokens = [(kind, value) for _, kind, value in _lexer.lex(template_source)]
    except jinja2.TemplateSyntaxError:
        return False
    previous = None
    for kind, value in tokens:
        if kind == "whitespace":
            continue
        if kind == "name" and value == "tools" and previous != ("operator", "."):
            return True
        previous = (kind, value)
    return False


def prepare_messages(
    messages: list[dict[str, Any]],
    tools: list[FunctionTool],
    choice: ToolChoice,
    *,
    renders_tools: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages for the chat template and the variables to render it with.

    A template that renders tools gets them as `tools` (chat-format dicts) and the calls'
    arguments as objects; for any other, the tools, the calls and their results are written into
    the messages in triode's format (see the module's docstring). Choice "none" offers no tools.
    """
    offered = tools if choice.mode != "none" else []
    if renders_tools:
        kwargs = {"tools": [_chat_tool(t) for t in offered]} if offered else {}
        return [_with_argument_objects(m) for m in messages], kwargs
    prepared: list[dict[str, Any]] = []
    after_tool = False
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if after_tool:
                prepared[-1]["content"] += "\n" + block
            else:
                prepared.append({"role": "user", "content": block})
        elif role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(c["function"]) for c in message["tool_calls"]]
            text = _text(message.get("content")).strip()
            written = {k: v for k, v in message.items() if k != "tool_calls"}
            written["content"] = "\n".join([text, *blocks] if text else blocks)
            prepared.append(written)
        else:
            prepared.append(message)
        after_tool = role == "tool"
    if offered:
        described = _describe(offered, choice)
        if prepared and prepared[0].get("role") in ("system", "developer"):
            first = prepared[0]
            text = _text(first.get("content")).rstrip()
            prepared[0] = {**first, "content": f"{text}\n\n{described}" if text else described}
        else:
            prepared.insert(0, {"role": "system", "content": described})
    return prepared, {}


def _describe(tools: list[FunctionTool], choice: ToolChoice) -> str:
    if choice.mode == "named":
        when = f"Answer by calling the function {choice.name}."
    elif choice.mode == "required":
        when = "Answer by calling one or more of the functions."
    else:
        when = "Call a function only when it helps to answer; otherwise answer in plain text."
    return "\n".join(
        [
            "# Tools",
            "",
            "You can call these functions, each described in JSON:",
            *(json.dumps(_chat_tool(t), ensure_ascii=False) for t in tools),
            "",
            "To call a function, write this block, with the arguments as a JSON object:",
            _OPEN,
            '{"name": "<function name>", "arguments": {...}}',
            _CLOSE,
            "Write one block per call, one after another for several calls. Each result comes"
            " back to you inside <tool_response></tool_response> tags.",
            when,
        ]
    )


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters if tool.parameters is not None else _NO_PARAMETERS
    return {"type": "function", "function": function}


def _call_block(function: dict[str, Any]) -> str:
    call = {"name": function["name"], "arguments": _arguments_object(function["arguments"])}
    return f"{_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{_CLOSE}"


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    # As transformers documents for templates: arguments are a mapping, not JSON text.
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = call["function"]
        arguments = _arguments_object(function["arguments"])
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed}


def _arguments_object(arguments: str) -> Any:
    # Text that is not a JSON object is passed on as it is.
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return str(content)


# Grammars


def call_grammar(tools: list[FunctionTool], choice: ToolChoice, *, parallel: bool) -> str | None:
    """The Lark grammar (llguidance's dialect) that a "required" choice (one call of any tool,
    or one or more with `parallel`) or a "named" one (one call of that tool) constrains the
    answer to; None for "auto" and "none", which leave it free."""
    if choice.mode == "required":
        return _lark(tools, many=parallel)
    if choice.mode == "named":
        return _lark([t for t in tools if t.name == choice.name], many=False)
    return None


def _lark(tools: list[FunctionTool], *, many: bool) -> str:
    if not tools:
        raise ValueError("a tool call grammar needs at least one tool")
    head = json.dumps(f'{_OPEN}\n{{"name": ')
    tail = json.dumps(f"}}\n{_CLOSE}")
    names = " | ".join(f"function{i}" for i in range(len(tools)))
    rules = [
        'start: call ("\\n" call)*' if many else "start: call",
        f"call: {head} ({names}) {tail}",
    ]
    for i, tool in enumerate(tools):
        name = json.dumps(f'"{tool.name}", "arguments": ')
        rules.append(f"function{i}: {name} arguments{i}")
        rules.append(f"arguments{i}: %json {_schema_text(tool)}")
    return "\n".join(rules) + "\n"


def _schema_text(tool: FunctionTool) -> str:
    schema = {"type": "object", **(tool.parameters or {}), "x-guidance": _JSON_OPTIONS}
    text = json.dumps(schema, ensure_ascii=False)
    # "::=" marks a grammar as GBNF to the engine; it can only occur inside JSON strings here,
    # where an escaped colon means the same.
    return text.replace("::=", ":\\u003a=")


# Answers


def parse_tool_calls(text: str, tools: list[FunctionTool]) -> tuple[str, list[ToolCall]]:
    """The content of a whole answer (the text outside its calls, stripped) and its calls;
    what `ToolCallStream` yields for the same text, all at once."""
    stream = ToolCallStream(tools)
    content: list[str] = []
    calls: list[ToolCall] = []
    for event in stream.feed(text) + stream.finish():
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif event.id is not None and event.name is not None:
            calls.append(ToolCall(event.id, event.name, event.arguments))
        else:
            calls[event.index].arguments += event.arguments
    return "".join(content), calls


class ToolCallStream:
    """Reads tool calls out of an answer as it streams.

    Content is passed on as it comes, except what cannot be decided yet: text that may begin
    `<tool_call>` and whitespace that may end the content. A block is held until it is known to
    be a call or not; a call then yields its id and name and, in the same batch, its arguments
    (compact JSON, as `parse_tool_calls` gives them), and a block that is no call yields its
    opening tag as content, the text after it read again. A call that repeats an earlier one
    ends the answer (`ended`): it and all that follows are dropped.
    """

    def __init__(self, tools: list[FunctionTool]) -> None:
        self._names = {t.name for t in tools}
        self._text = ""  # undecided text: after an opening tag when `_in_call`
        self._in_call = False
        self._space = ""  # whitespace after the content so far
        self._started = False
        self._calls = 0
        self._seen: set[tuple[str, str]] = set()
        self.ended = False  # a repeated call ended the answer; what follows is dropped
        self._events: list[StreamEvent] = []
        self._reset_block()

    def feed(self, delta: str) -> list[StreamEvent]:
        """The events that `delta`, appended to the answer, decides."""
        if self.ended:
            return []
        self._text += delta
        return self._advance(final=False)

    def finish(self) -> list[StreamEvent]:
        """The events of the held text, at the end of the answer."""
        if self.ended:
            return []
        return self._advance(final=True)

    def _reset_block(self) -> None:
        self._start = -1  # where the JSON object begins in `_text`
        self._pos = 0  # how far it is scanned
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._end = -1  # just past the object
        self._call: tuple[str, str] | None = None

    def _advance(self, *, final: bool) -> list[StreamEvent]:
        while True:
            if not self._in_call:
                at = self._text.find(_OPEN)
                if at < 0:
                    keep = 0 if final else _partial_tag(self._text)
                    self._content(self._text[: len(self._text) - keep])
                    self._text = self._text[len(self._text) - keep :]
                    break
                self._content(self._text[:at])
                self._text = self._text[at + len(_OPEN) :]
                self._in_call = True
                self._reset_block()
            verdict = self._read_block(final=final)
            if verdict is None:
                break
            self._in_call = False
            if verdict < 0:
                self._content(_OPEN)
                continue
            assert self._call is not None
            if self._call in self._seen:
                self.ended = True
                self._text = ""
                break
            self._seen.add(self._call)
            name, arguments = self._call
            index, self._calls = self._calls, self._calls + 1
            call_id = f"call_{secrets.token_hex(12)}"
            self._events += [
                ToolCallDelta(index, call_id, name, ""),
                ToolCallDelta(index, None, None, arguments),
            ]
            self._text = self._text[verdict:]
        events, self._events = self._events, []
        return events

    def _read_block(self, *, final: bool) -> int | None:
        # None: undecided; -1: no call; otherwise the length of the block past the opening tag.
        text = self._text
        if self._start < 0:
            rest = text.lstrip()
            if not rest:
                return -1 if final else None
            if rest[0] != "{":
                return -1
            self._start = self._pos = len(text) - len(rest)
        if self._end < 0:
            end = self._scan_object()
            if end is None:
                return -1
            if end < 0:
                return -1 if final else None
            self._end = end
            self._call = self._call_of(text[self._start : end])
            if self._call is None:
                return -1
        tail = text[self._end :].lstrip()
        if tail.startswith(_CLOSE):
            return len(text) - len(tail) + len(_CLOSE)
        if _CLOSE.startswith(tail):
            return len(text) if final else None
        return -1

    def _scan_object(self) -> int | None:
        # Where the object ends (-1: not yet), by its brackets; None for text no JSON holds.
        text = self._text
        for pos in range(self._pos, len(text)):
            ch = text[pos]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                elif ch < " ":
                    return None
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return pos + 1
            elif ch == "<":
                return None
        self._pos = len(text)
        return -1

    def _call_of(self, text: str) -> tuple[str, str] | None:
        try:
            value = json.loads(text, parse_constant=_no_constant)
        except ValueError:
            return None
        name, arguments = value.get("name"), value.get("arguments")
        if not isinstance(name, str) or name not in self._names or not isinstance(arguments, dict):
            return None
        return name, json.dumps(arguments, ensure_ascii=False)

    def _content(self, text: str) -> None:
        if not text:
            return
        text = self._space + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        if not body:
            return
        self._started = True
        last = self._events[-1] if self._events else None
        if isinstance(last, ContentDelta):
            self._events[-1] = ContentDelta(last.text + body)
        else:
            self._events.append(ContentDelta(body))


def _partial_tag(text: str) -> int:
    # The length of the longest end of `text` that begins an opening tag.
    for n in range(min(len(text), len(_OPEN) - 1), 0, -1):
        if text.endswith(_OPEN[:n]):
            return n
    return 0


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")
