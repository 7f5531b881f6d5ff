"""A Responses request checked whole, before anything is answered.

`plan_response` turns the input into chat messages (after those of its `previous_response_id`),
lists the tools of its MCP servers, parses its tool choice and text format, and renders and
measures its first prompt, so that every bad input is a 400 naming the field. The `Plan` it
returns is what a run needs: the conversation it extends, the tools the model sees (an MCP
tool as a function under its own name, or `<server_label>__<tool>` when names clash) and how
each turn is constrained.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import trio

from triode.actors import Engine, Intake
from triode.wire import StructuredOutputsParams

from ..completions.structured import (
    check_structured,
    structured_from_grammar,
    structured_from_text_format,
)
from ..errors import APIError, validation_error
from ..tools.calls import call_grammar
from ..tools.choice import (
    FunctionTool,
    ToolChoice,
    parse_tool_choice,
    parse_tools,
    prepare_messages,
    template_renders_tools,
)
from ..tools.mcp import ToolServerError, ToolServers, ToolServerUnavailable
from .input_items import input_messages
from .request import McpToolSpec, ResponsesRequest, mcp_tool_specs
from .response import McpListTools, McpToolInfo, Response, ResponseUsage, new_id
from .store import ResponseStore

NO_TOOLS = ToolChoice(mode="none", name=None)


@dataclass
class Plan:
    """A checked request: everything a run needs, and the conversation it extends."""

    req: ResponsesRequest
    response: Response
    system: list[dict[str, Any]]
    conversation: list[dict[str, Any]]  # history + input; each turn's messages are appended
    tools: list[FunctionTool]
    choice: ToolChoice
    forced: list[FunctionTool] | None  # the tools a required choice picks from, if not all
    mcp_routes: dict[str, tuple[str, str, str | None]]  # function -> (label, tool, server_url)
    listings: list[McpListTools]
    structured: StructuredOutputsParams | None
    renders_tools: bool
    first_ids: list[int]
    mcp_names: dict[tuple[str, str], str] = field(default_factory=dict)
    max_tool_turns: int = 8
    cache_salt: str | None = None  # what its KV blocks are hashed with (edge/tenancy.py)
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)

    def mcp_name(self, label: str, tool: str) -> str:
        """The function name the model knows an MCP tool by."""
        return _mcp_name(self.mcp_names, label, tool)

    def mcp_tools(self) -> dict[str, tuple[str, str]]:
        """Function name -> (server label, tool name), for each MCP tool offered."""
        return {name: (label, tool) for name, (label, tool, _) in self.mcp_routes.items()}

    def server_url(self, label: str, tool: str) -> str | None:
        """The `server_url` the request gave for the server of an MCP tool, if any."""
        urls = (url for lb, t, url in self.mcp_routes.values() if (lb, t) == (label, tool))
        return next(urls, None)

    def turn_choice(self, choice: ToolChoice, *, rounds: int, calls: int) -> ToolChoice:
        """`choice`, or no tools at all once the tool rounds or calls are used up. A required
        or named choice forces the first round only; after its results the model may answer
        (`auto`), or it would call tools until the rounds run out."""
        limit = self.req.max_tool_calls
        spent = rounds >= self.max_tool_turns or (limit is not None and calls >= limit)
        if not self.tools or spent:
            return NO_TOOLS
        if rounds > 0 and choice.mode in ("required", "named"):
            return ToolChoice(mode="auto")
        return choice

    def constraint(self, choice: ToolChoice) -> StructuredOutputsParams | None:
        """What a turn's output is held to: a call, under a required or named choice; else
        the text format, unless the model may choose to call a tool instead."""
        if choice.mode in ("required", "named"):
            tools = self.forced if self.forced is not None else self.tools
            grammar = call_grammar(tools, choice, parallel=self.response.parallel_tool_calls)
            return None if grammar is None else structured_from_grammar(grammar)
        return self.structured if choice.mode == "none" else None

    async def encode(self, intake: Intake, choice: ToolChoice) -> list[int]:
        """The prompt of the next turn. Raises ValueError when the template refuses it."""
        messages, extra = prepare_messages(
            [*self.system, *self.conversation], self.tools, choice,
            renders_tools=self.renders_tools,
        )  # fmt: skip
        _, ids = await intake.encode_chat(messages, template_kwargs=extra or None)
        return ids


async def plan_response(
    req: ResponsesRequest,
    *,
    engine: Engine,
    store: ResponseStore,
    tool_servers: ToolServers,
    model_name: str,
    max_tool_turns: int,
    owner: bytes = b"",
) -> Plan:
    """Check `req` whole: its previous response, tools (listing each MCP server's), tool
    choice, text format and input, and render and measure its first prompt. A checkpoint
    (MCP listings, tokenizing); raises a 4xx `APIError` naming the field for a bad request.
    A previous response that `owner` (the caller's key digest) did not create is not found.
    """
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id, owner)
        if previous is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' "
                           "not found.", type="invalid_request_error",
                           param="previous_response_id",
                           code="previous_response_not_found")  # fmt: skip
        if previous.conversation is None:
            raise APIError(400, "previous_response_id: that response is still in progress",
                           param="previous_response_id")  # fmt: skip
        history = previous.conversation
    template = engine.intake.chat_template
    if template is None:
        raise APIError(400, "input: this model has no chat template; use /v1/completions",
                       param="input")  # fmt: skip
    functions = parse_tools(req.tools, param="tools", flat=True)
    specs = mcp_tool_specs(req.tools)
    listings, offered = await _list_mcp_tools(tool_servers, specs)
    tools, routes, names = _mcp_functions(functions, offered)
    down = {listing.server_label for listing in listings if listing.error is not None}
    choice, forced = _tool_choice(req.tool_choice, tools, routes, names, down)
    fmt = req.text.format if req.text is not None else None
    structured = None if fmt is None else structured_from_text_format(fmt, param="text.format")
    await check_structured(structured, param="text.format")
    messages = input_messages(
        req.input, mcp_name=lambda label, tool: _mcp_name(names, label, tool), history=history
    )
    response = Response(
        id=new_id("resp"),
        background=bool(req.background),
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        max_tool_calls=req.max_tool_calls,
        model=req.model or model_name,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        store=req.store is not False,
        # unset: the model's default (its generation config), else vLLM's
        temperature=engine.generation_defaults.get("temperature", 1.0)
        if req.temperature is None
        else req.temperature,
        top_p=engine.generation_defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
        text={"format": fmt or {"type": "text"}},
        tool_choice=req.tool_choice or "auto",
        tools=list(req.tools or ()),
        usage=ResponseUsage(),
        user=req.user,
        metadata=dict(req.metadata or {}),
    )
    system = [] if req.instructions is None else [
        {"role": "system", "content": req.instructions}
    ]  # fmt: skip
    plan = Plan(
        req=req, response=response, system=system, conversation=[*history, *messages],
        tools=tools, choice=choice, forced=forced, mcp_routes=routes, listings=listings,
        structured=structured, renders_tools=template_renders_tools(template.source),
        first_ids=[], mcp_names=names, max_tool_turns=max_tool_turns,
    )  # fmt: skip
    first_choice = plan.turn_choice(choice, rounds=0, calls=0)
    if first_choice.mode in ("required", "named"):
        await check_structured(plan.constraint(first_choice), param="tools")
    try:
        plan.first_ids = await plan.encode(engine.intake, first_choice)
    except ValueError as e:
        raise validation_error(e) from e
    limit = engine.max_model_len
    if len(plan.first_ids) >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                       f"However, your request has {len(plan.first_ids)} input tokens. "
                       "Please reduce the length of the input.", param="input")  # fmt: skip
    return plan


async def _list_mcp_tools(
    tool_servers: ToolServers, specs: list[tuple[int, McpToolSpec]]
) -> tuple[list[McpListTools], list[tuple[McpToolSpec, list[McpToolInfo]]]]:
    """Each MCP server's tools (concurrently): an `mcp_list_tools` item per server (with
    `error` for one that is down) and the allowed tools. A 400 for a refused server."""
    listings = [McpListTools(id=new_id("mcpl"), server_label=s.server_label) for _, s in specs]
    refused: list[APIError] = []

    async def list_one(listing: McpListTools, index: int, spec: McpToolSpec) -> None:
        try:
            found = await tool_servers.list_tools(spec.server_label, server_url=spec.server_url)
        except ToolServerUnavailable as e:
            listing.error = str(e)
            return
        except ToolServerError as e:
            where = f"tools[{index}]." + ("server_url" if spec.server_url else "server_label")
            refused.append(APIError(400, f"{where}: {e}", param=where))
            return
        allowed = spec.allowed()
        listing.tools = [
            McpToolInfo(name=t.name, description=t.description, input_schema=t.input_schema)
            for t in found
            if allowed is None or t.name in allowed
        ]

    async with trio.open_nursery() as nursery:
        for listing, (index, spec) in zip(listings, specs, strict=True):
            nursery.start_soon(list_one, listing, index, spec)
    if refused:
        raise refused[0]
    offered = [(spec, listing.tools) for listing, (_, spec) in zip(listings, specs, strict=True)]
    return listings, offered


def _mcp_functions(
    functions: list[FunctionTool],
    offered: list[tuple[McpToolSpec, list[McpToolInfo]]],
) -> tuple[
    list[FunctionTool], dict[str, tuple[str, str, str | None]], dict[tuple[str, str], str]
]:  # fmt: skip
    """The function tools the model sees: the request's, then each MCP tool under its own name
    when that is unique, else as `<server_label>__<tool>`."""
    counts: dict[str, int] = {}
    for t in functions:
        counts[t.name] = counts.get(t.name, 0) + 1
    for _, tools in offered:
        for t in tools:
            counts[t.name] = counts.get(t.name, 0) + 1
    tools = list(functions)
    routes: dict[str, tuple[str, str, str | None]] = {}
    names: dict[tuple[str, str], str] = {}
    for spec, found in offered:
        for t in found:
            name = t.name if counts[t.name] == 1 else f"{spec.server_label}__{t.name}"
            schema = t.input_schema if isinstance(t.input_schema, dict) else {}
            tools.append(FunctionTool(name=name, description=t.description or "",
                                      parameters=schema or {"type": "object", "properties": {}},
                                      strict=False))  # fmt: skip
            routes[name] = (spec.server_label, t.name, spec.server_url)
            names[(spec.server_label, t.name)] = name
    return tools, routes, names


def _mcp_name(names: dict[tuple[str, str], str], label: str, tool: str) -> str:
    # a tool the request does not offer (a call in the input, say) keeps its qualified name
    return names.get((label, tool), f"{label}__{tool}")


def _tool_choice(
    raw: str | dict[str, Any] | None,
    tools: list[FunctionTool],
    routes: dict[str, tuple[str, str, str | None]],
    names: dict[tuple[str, str], str],
    down: AbstractSet[str] = frozenset(),
) -> tuple[ToolChoice, list[FunctionTool] | None]:
    """The request's `tool_choice`, and the tools a required choice picks from when that is not
    all of them (`{"type": "mcp", "server_label"}`: that server's). A choice that only the
    servers that are `down` could meet is no choice: the model answers without their tools."""
    if isinstance(raw, dict) and raw.get("type") == "mcp":
        extra = set(raw) - {"type", "server_label", "name"}
        if extra:
            raise APIError(400, f"tool_choice: unknown field {sorted(extra)[0]!r}",
                           param="tool_choice")  # fmt: skip
        label, tool = raw.get("server_label"), raw.get("name")
        if isinstance(label, str) and label in down:
            return NO_TOOLS, None
        offered = [t for t in tools if t.name in routes and routes[t.name][0] == label]
        if not offered:
            raise APIError(400, f"tool_choice.server_label: no tools from a server {label!r}",
                           param="tool_choice.server_label")  # fmt: skip
        if tool is None:
            return ToolChoice(mode="required", name=None), offered
        name = names.get((str(label), str(tool)))
        if name is None:
            raise APIError(400, f"tool_choice.name: {label!r} has no tool {tool!r}",
                           param="tool_choice.name")  # fmt: skip
        return ToolChoice(mode="named", name=name), None
    if isinstance(raw, dict) and raw.get("type") != "function":
        raise APIError(400, f"tool_choice.type: {raw.get('type')!r} is not supported",
                       param="tool_choice.type")  # fmt: skip
    if raw == "required" and not tools and down:
        return NO_TOOLS, None
    return parse_tool_choice(raw, tools, param="tool_choice", flat=True), None
