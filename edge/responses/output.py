"""`ResponseBuilder`: the one place that changes a response's output.

Every change both updates the `Response` object and, when streaming, queues the SSE event that
tells the client about it, in the order the openai SDK's snapshot accumulator checks: an item is
added before its content, its content is done before the item, every item is done before the
response completes, and output indexes are the items' places in `output`. A stored response and
the snapshot a client built from the stream therefore cannot disagree.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..sse import event as sse_event
from .events import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ItemProgressEvent,
    OutputItemEvent,
    ResponseEvent,
    TextDeltaEvent,
    TextDoneEvent,
    encode,
)
from .response import (
    TERMINAL,
    FunctionCall,
    IncompleteDetails,
    McpCall,
    McpListTools,
    OutputItem,
    OutputMessage,
    OutputText,
    Response,
    ResponseError,
    Status,
    mcp_error,
    new_id,
)

_FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


@dataclass
class Turn:
    """What one generation added: its text and the calls it made, in order."""

    text: str = ""
    calls: list[FunctionCall | McpCall] = field(default_factory=list)


class ResponseBuilder:
    """Builds `response.output` from one generation after another.

    `mcp_tools` maps the function names the model sees to (server label, tool name): a call to
    one of those becomes an `mcp_call` item, any other call a `function_call` item. With
    `streaming`, each change queues its SSE frame; `take()` hands the queued frames over.
    """

    def __init__(
        self,
        response: Response,
        *,
        streaming: bool,
        mcp_tools: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        self.response = response
        self.streaming = streaming
        self._mcp_tools = dict(mcp_tools or {})
        self._frames: list[bytes] = []
        self._sequence = 0
        self._message: tuple[int, OutputMessage] | None = None
        self._held = ""  # leading whitespace, kept back until the message has more than that
        self._calls: dict[int, tuple[int, FunctionCall | McpCall]] = {}
        self._open_calls: dict[str, int] = {}  # mcp_call item id -> output index, until run
        self._turn = Turn()

    def take(self) -> list[bytes]:
        """The SSE frames queued since the last call."""
        frames, self._frames = self._frames, []
        return frames

    def _emit(self, kind: type[Any], type: str, **fields: Any) -> None:
        if self.streaming:
            event = kind(type=type, sequence_number=self._sequence, **fields)
            self._sequence += 1
            self._frames.append(sse_event(encode(event), name=event.type))

    def _add(self, item: OutputItem) -> int:
        index = len(self.response.output)
        self.response.output.append(item)
        self._emit(OutputItemEvent, "response.output_item.added", output_index=index, item=item)
        return index

    def _done(self, index: int) -> None:
        item = self.response.output[index]
        self._emit(OutputItemEvent, "response.output_item.done", output_index=index, item=item)

    # The response

    def start(self) -> None:
        """The response is under way: `response.created`, then `response.in_progress`."""
        self.response.status = "in_progress"
        self._emit(ResponseEvent, "response.created", response=self.response)
        self._emit(ResponseEvent, "response.in_progress", response=self.response)

    def finish(
        self,
        status: Status,
        *,
        reason: str | None = None,
        error: ResponseError | None = None,
    ) -> Turn:
        """End the response with `status`; anything still open is closed as incomplete, and
        what the generation cut short had made is returned. A cancelled response gets no final
        event: the stream just ends."""
        if self.response.status in TERMINAL:
            return Turn()
        turn = self.end_turn(complete=False)
        for index in self._open_calls.values():
            self.response.output[index].status = "incomplete"  # type: ignore[union-attr]
            self._done(index)
        self._open_calls = {}
        self.response.status = status
        self.response.completed_at = int(time.time())
        if reason is not None:
            self.response.incomplete_details = IncompleteDetails(reason=reason)
        self.response.error = error
        if status in _FINAL_EVENTS:
            self._emit(ResponseEvent, _FINAL_EVENTS[status], response=self.response)
        return turn

    # MCP tool listings

    def list_tools(self, item: McpListTools) -> None:
        """An `mcp_list_tools` item, whole: added, in progress, completed (or failed), done."""
        index = self._add(item)
        self._emit(ItemProgressEvent, "response.mcp_list_tools.in_progress",
                   item_id=item.id, output_index=index)  # fmt: skip
        outcome = "failed" if item.error is not None else "completed"
        self._emit(ItemProgressEvent, f"response.mcp_list_tools.{outcome}",
                   item_id=item.id, output_index=index)  # fmt: skip
        self._done(index)

    # One generation

    def text(self, delta: str) -> None:
        """More of the answer's text."""
        if not delta:
            return
        if self._message is None:
            if not (self._held + delta).strip():
                self._held += delta
                return
            delta, self._held = self._held + delta, ""
            self._open_message()
        self._append(delta)

    def _append(self, delta: str) -> None:
        assert self._message is not None
        index, message = self._message
        message.content[0].text += delta
        self._turn.text += delta
        self._emit(TextDeltaEvent, "response.output_text.delta", item_id=message.id,
                   output_index=index, content_index=0, delta=delta)  # fmt: skip

    def _open_message(self) -> None:
        message = OutputMessage(id=new_id("msg"))
        index = self._add(message)
        part = OutputText()
        message.content.append(part)
        self._emit(ContentPartEvent, "response.content_part.added", item_id=message.id,
                   output_index=index, content_index=0, part=OutputText())  # fmt: skip
        self._message = (index, message)

    def _close_message(self, status: str) -> None:
        if self._message is None:
            return
        index, message = self._message
        self._message = None
        part = message.content[0]
        self._emit(TextDoneEvent, "response.output_text.done", item_id=message.id,
                   output_index=index, content_index=0, text=part.text)  # fmt: skip
        self._emit(ContentPartEvent, "response.content_part.done", item_id=message.id,
                   output_index=index, content_index=0, part=part)  # fmt: skip
        message.status = status
        self._done(index)

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        """More of the call the model numbered `index` in this generation: its first delta
        names it and opens its item (closing the text before it), later ones add arguments."""
        entry = self._calls.get(index)
        if entry is None:
            self._close_message("completed")
            self._held = ""
            name = name or ""
            route = self._mcp_tools.get(name)
            item: FunctionCall | McpCall
            if route is not None:
                item = McpCall(id=new_id("mcp"), server_label=route[0], name=route[1])
            else:
                item = FunctionCall(id=new_id("fc"), call_id=call_id or new_id("call"), name=name)
            entry = self._calls[index] = (self._add(item), item)
            self._turn.calls.append(item)
        output_index, item = entry
        if not arguments:
            return
        item.arguments += arguments
        kind = "mcp_call_arguments" if isinstance(item, McpCall) else "function_call_arguments"
        self._emit(ArgumentsDeltaEvent, f"response.{kind}.delta", item_id=item.id,
                   output_index=output_index, delta=arguments)  # fmt: skip

    def end_turn(self, *, complete: bool = True) -> Turn:
        """The generation ended: close its text and its calls, and say what it made.

        A `function_call` item is done here; an `mcp_call` item stays open for `mcp_result`.
        With `complete` false (cut short), nothing is left open and every item is incomplete.
        A generation with neither text nor calls still leaves a (possibly empty) message.
        """
        status = "completed" if complete else "incomplete"
        if self._message is None and not self._calls and (complete or self._held):
            self._open_message()
            if self._held:
                self._append(self._held)
        self._held = ""
        self._close_message(status)
        for output_index, item in self._calls.values():
            kind = "mcp_call_arguments" if isinstance(item, McpCall) else "function_call_arguments"
            self._emit(ArgumentsDoneEvent, f"response.{kind}.done", item_id=item.id,
                       output_index=output_index, arguments=item.arguments)  # fmt: skip
            if isinstance(item, FunctionCall) or not complete:
                item.status = status
                self._done(output_index)
            else:
                self._open_calls[item.id] = output_index
                self._emit(ItemProgressEvent, "response.mcp_call.in_progress",
                           item_id=item.id, output_index=output_index)  # fmt: skip
        self._calls = {}
        turn, self._turn = self._turn, Turn()
        return turn

    def mcp_result(self, item: McpCall, output: str | None, error: str | None) -> None:
        """The outcome of an `mcp_call` item that `end_turn` left open."""
        index = self._open_calls.pop(item.id)
        item.output = output
        item.error = None if error is None else mcp_error(error)
        item.status = "failed" if error is not None else "completed"
        self._emit(ItemProgressEvent, f"response.mcp_call.{item.status}", item_id=item.id,
                   output_index=index)  # fmt: skip
        self._done(index)
