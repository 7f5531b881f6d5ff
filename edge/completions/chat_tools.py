"""A chat request's tools: how its prompt describes them, and how the calls of a whole (not
streamed) answer are read out of its text; a stream's calls are parsed as it goes
(`streams.ChatStream`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from triode.actors import RequestOutput

from ..tools.calls import ToolCallReader, call_grammar
from ..tools.choice import (
    FunctionTool,
    ToolChoice,
    check_tool_messages,
    parse_tool_choice,
    parse_tools,
    prepare_messages,
)
from .request_bodies import ChatCompletionRequest
from .response_bodies import ChatMessageOut, FunctionCallOut, ToolCallOut


@dataclass
class ChatTools:
    """A chat request's tools: how its prompt describes them and how its output is read."""

    tools: list[FunctionTool]
    choice: ToolChoice
    grammar: str | None  # forcing a call, for a required or named choice

    @classmethod
    def of(cls, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> ChatTools | None:
        """None for a request with neither tools nor tool messages: nothing changes for it."""
        check_tool_messages(messages)
        history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if req.tools is None and req.tool_choice is None and not history:
            return None
        tools = parse_tools(req.tools) if req.tools is not None else []
        choice = parse_tool_choice(req.tool_choice, tools)
        parallel = req.parallel_tool_calls is not False
        return cls(tools, choice, call_grammar(tools, choice, parallel=parallel))

    def prepare(
        self, messages: list[dict[str, Any]], *, renders_tools: bool
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return prepare_messages(messages, self.tools, self.choice, renders_tools=renders_tools)

    @property
    def calls(self) -> bool:
        """Whether the answer may call tools."""
        return bool(self.tools) and self.choice.mode != "none"


class CallReaders:
    """Each choice's calls, read as a whole (not streamed) chat answer comes, so that its
    generation stops once every choice has repeated a call (which ends an answer: see
    `edge/tools/calls.py`). Called with every delta, as `stop_when`."""

    def __init__(self, tools: list[FunctionTool], n: int) -> None:
        self.of = [ToolCallReader(tools) for _ in range(n)]

    def __call__(self, index: int, out: RequestOutput) -> bool:
        for c in out.outputs:
            if c.text:
                self.of[c.index].feed(c.text)
        return all(reader.ended for reader in self.of)


def tool_message(
    reader: ToolCallReader, finish_reason: str | None
) -> tuple[ChatMessageOut, str | None]:
    """The assistant message of a whole answer, its calls taken out of its text."""
    content, calls = reader.finish()
    message = ChatMessageOut(
        content=content or None,
        tool_calls=[
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls
        ],
    )
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return message, finish_reason
