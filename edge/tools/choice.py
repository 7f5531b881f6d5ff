"""Tool calling for chat completions and responses: the request's `tools` and `tool_choice`,
the tool messages of its conversation, and the prompt that describes the tools (a template's
own, or triode's format, which `tool_calls` documents and reads back).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, NoReturn

import jinja2
import llguidance
import msgspec

from .. import json_text
from ..errors import APIError
from .calls import CALL_CLOSE as _CLOSE
from .calls import CALL_OPEN as _OPEN
from .calls import call_grammar

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
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
        try:
            json_text.check_depth(parameters)
        except ValueError as e:
            _fail(f"{where}.parameters", f"the JSON schema is {e}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        _fail(f"{where}.strict", "must be a boolean")
    tool = FunctionTool(name, description, parameters, strict)
    lark = call_grammar([tool], ToolChoice(mode="named", name=tool.name), parallel=False)
    assert lark is not None
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
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
    if (too_deep := json_text.nesting_error(function["arguments"])) is not None:
        _fail(f"{where}.function.arguments", too_deep)
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
        value = json_text.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return str(content)
