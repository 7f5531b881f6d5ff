"""Tool calls in a model's text: the one format triode reads and writes for templates that do
not render tools, the grammar that forces a call in it, and the parser that reads calls back
out of an answer, whole or as it streams.

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
import secrets
from typing import TYPE_CHECKING, NoReturn

import msgspec

from .. import json_text

if TYPE_CHECKING:
    from .choice import FunctionTool, ToolChoice

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# The separators of json.dumps, which the prompt's calls use too, and no other whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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
    head = json.dumps(f'{CALL_OPEN}\n{{"name": ')
    tail = json.dumps(f"}}\n{CALL_CLOSE}")
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
    reader = ToolCallReader(tools)
    reader.feed(text)
    return reader.finish()


class ToolCallReader:
    """A whole answer's content and calls, read as its text arrives: `finish` gives what
    `parse_tool_calls` gives for the text at once, and `ended` turns true as soon as a repeated
    call has ended the answer."""

    def __init__(self, tools: list[FunctionTool]) -> None:
        self._stream = ToolCallStream(tools)
        self._content: list[str] = []
        self._calls: list[ToolCall] = []

    @property
    def ended(self) -> bool:
        return self._stream.ended

    def feed(self, delta: str) -> None:
        self._take(self._stream.feed(delta))

    def finish(self) -> tuple[str, list[ToolCall]]:
        self._take(self._stream.finish())
        return "".join(self._content), self._calls

    def _take(self, events: list[StreamEvent]) -> None:
        for event in events:
            if isinstance(event, ContentDelta):
                self._content.append(event.text)
            elif event.id is not None and event.name is not None:
                self._calls.append(ToolCall(event.id, event.name, event.arguments))
            else:
                self._calls[event.index].arguments += event.arguments


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
                at = self._text.find(CALL_OPEN)
                if at < 0:
                    keep = 0 if final else _partial_tag(self._text)
                    self._content(self._text[: len(self._text) - keep])
                    self._text = self._text[len(self._text) - keep :]
                    break
                self._content(self._text[:at])
                self._text = self._text[at + len(CALL_OPEN) :]
                self._in_call = True
                self._reset_block()
            verdict = self._read_block(final=final)
            if verdict is None:
                break
            self._in_call = False
            if verdict < 0:
                self._content(CALL_OPEN)
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
        if tail.startswith(CALL_CLOSE):
            return len(text) - len(tail) + len(CALL_CLOSE)
        if CALL_CLOSE.startswith(tail):
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
            # the model's text: as deep as its tokens go, which a bound keeps off the stack
            value = json_text.loads(text, parse_constant=_no_constant)
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
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if text.endswith(CALL_OPEN[:n]):
            return n
    return 0


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")
