"""A model's chat template, rendered the way transformers' `apply_chat_template` renders it.

Templates come from the Hub and are untrusted code: they run in jinja's immutable sandbox with the
environment transformers builds (`trim_blocks`, `lstrip_blocks`, loop controls, the `generation`
tag, the `raise_exception` and `strftime_now` globals, a `tojson` that does not escape HTML, and
`dict` and `namespace` that refuse underscore names), so a template renders here as it does there.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The special tokens transformers passes to every template (its `special_tokens_map`).
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Appended to the final message under `continue_final_message`, then cut with what follows it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template does not compile: {e}") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_model_dir(cls, path: Path) -> ChatTemplate:
        """The template of the Hugging Face model in `path`.

        `chat_template.jinja` wins over `tokenizer_config.json`'s `chat_template` (a string, or a
        list of named templates of which "default" is used). Raises ValueError if there is none.
        """
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        jinja_path = path / "chat_template.jinja"
        source = jinja_path.read_text() if jinja_path.is_file() else config.get("chat_template")
        if isinstance(source, list):
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str) or not source:
            raise ValueError(
                f"the model in {path} has no chat template (no chat_template.jinja, and no"
                " chat_template in tokenizer_config.json); use the completions API instead"
            )
        special = {}
        for name in _SPECIAL_TOKENS:
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str):
                special[name] = token
        return cls(source, special_tokens=special)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`.

        Message `content` may be a string or a list of OpenAI text parts, which are joined with
        newlines; keys whose value is None are dropped, as transformers does. `kwargs` reach the
        template as variables and override the special tokens. With `continue_final_message` the
        text ends inside the last message, so the model continues it.

        Raises ValueError for non-text content and for any error the template raises.
        """
        chat = [_plain_message(i, m) for i, m in enumerate(messages)]
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message: cannot be combined with add_generation_prompt"
                )
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise ValueError("continue_final_message: the final message has no content")
            final = chat[-1]["content"]
            chat[-1]["content"] = final + _CONTINUE_TAG
        context = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        try:
            text = self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise ValueError(e.message or type(e).__name__) from e
        except TypeError as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from e
        if continue_final_message:
            text = _cut_at_tag(text, final)
        return text


def _plain_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    plain = {k: v for k, v in message.items() if v is not None}
    content = plain.get("content")
    if isinstance(content, list):
        plain["content"] = "\n".join(_text_part(index, part) for part in content)
    return plain


def _text_part(index: int, part: Any) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text":
        raise ValueError(f"messages[{index}].content: only text content is supported")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"messages[{index}].content: a text part needs a string `text`")
    return text


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message: the chat template drops part of the final message"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    # The template trimmed the whitespace after the tag, and with it any the message ended in.
    return text[:at].rstrip()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which would change what the model sees.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    # `dict` for templates, without the class object they could climb from.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore names on a namespace would reach CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
        )


class _GenerationTag(jinja2.ext.Extension):
    # `{% generation %}` marks assistant text for transformers' training masks; rendering it is
    # rendering its body (in a call block's scope, as there).
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
