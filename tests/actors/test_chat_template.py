"""Chat templates render as transformers renders them, from the files a model directory holds."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from triode.actors.chat_template import ChatTemplate

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is the capital of Italy?"},
    ],
    [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two, three."},
        {"role": "user", "content": "Now backwards,\nplease."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
    ],
]

# A template that leans on what transformers' environment provides: special tokens, tojson,
# raise_exception, loop controls, namespace, the generation tag, and trim/lstrip of blocks.
FEATURES_TEMPLATE = """\
{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    <{{ message['role'] }}>{{ message | tojson }}
    {% if message['role'] == 'assistant' %}
        {% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {% endif %}
    {% if ns.turns >= 3 %}
        {% break %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}
"""


def _write_model(path: Path, *, jinja: str | None = None, **config: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


@functools.cache
def _default_model_dir() -> Path:
    from triode.gpu.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    try:
        return _default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not fetched ({e}); run `make model`")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_default_model_renders_as_transformers_does(
    model_dir: Path, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )

    template = ChatTemplate.from_model_dir(model_dir)

    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_default_model_continues_the_final_message_as_transformers_does(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Bl"},
    ]
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, continue_final_message=True
    )

    rendered = ChatTemplate.from_model_dir(model_dir).render(
        messages, add_generation_prompt=False, continue_final_message=True
    )

    assert rendered == expected
    assert rendered.endswith("assistant\nBl")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_sandbox_helpers_render_as_in_transformers(
    messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    (expected,), _ = render_jinja_template(
        conversations=[messages],
        chat_template=FEATURES_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        **tokens,
    )

    template = ChatTemplate(FEATURES_TEMPLATE, special_tokens=tokens)

    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path: Path) -> None:
    model = _write_model(tmp_path, jinja="from jinja", chat_template="from config")
    assert ChatTemplate.from_model_dir(model).render([]) == "from jinja"


def test_tokenizer_config_named_templates_use_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    model = _write_model(tmp_path, chat_template=named)
    assert ChatTemplate.from_model_dir(model).render([]) == "plain"


def test_special_tokens_may_be_strings_or_added_token_dicts(tmp_path: Path) -> None:
    model = _write_model(
        tmp_path,
        chat_template="{{ bos_token }}|{{ eos_token }}",
        bos_token={"content": "<s>", "lstrip": False, "special": True},
        eos_token="</s>",
    )
    template = ChatTemplate.from_model_dir(model)
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert template.render([]) == "<s>|</s>"
    assert template.render([], eos_token="<end>") == "<s>|<end>"


@pytest.mark.parametrize(
    "config", [{}, {"chat_template": None}, {"chat_template": [{"name": "rag", "template": "x"}]}]
)
def test_model_without_a_chat_template_is_a_value_error(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match="has no chat template"):
        ChatTemplate.from_model_dir(_write_model(tmp_path, **config))


def test_template_that_does_not_compile_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_raise_exception_becomes_a_value_error_with_the_templates_message() -> None:
    template = ChatTemplate(FEATURES_TEMPLATE, special_tokens={"bos_token": "", "eos_token": ""})
    with pytest.raises(ValueError, match=r"^Unknown role: tool$"):
        template.render([{"role": "tool", "content": "42"}])


def test_text_parts_are_joined_with_newlines() -> None:
    template = ChatTemplate("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert template.render([{"role": "user", "content": parts}]) == "[first\nsecond]"


@pytest.mark.parametrize(
    "part", [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text"}, "text"]
)
def test_parts_other_than_text_are_a_value_error(part: Any) -> None:
    template = ChatTemplate("{{ messages }}")
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content: "):
        template.render([{"role": "system", "content": "s"}, {"role": "user", "content": [part]}])


def test_none_values_are_dropped_from_messages() -> None:
    template = ChatTemplate("{% for m in messages %}{{ 'name' in m }},{{ m | length }}{% endfor %}")
    message = {"role": "assistant", "content": "x", "name": None, "tool_calls": None}
    assert template.render([message]) == "False,2"


def test_strftime_now_formats_the_current_time() -> None:
    assert ChatTemplate("{{ strftime_now('%Y') }}").render([]).isdigit()


def test_tojson_does_not_escape_html_or_unicode() -> None:
    rendered = ChatTemplate("{{ messages[0] | tojson }}").render(
        [{"role": "user", "content": "<é>"}]
    )
    assert rendered == '{"role": "user", "content": "<é>"}'


@pytest.mark.parametrize(
    ("source", "unsafe"),
    [
        ("{{ ''.__class__.__mro__ }}", "__class__"),
        ("{% set x = messages.append(1) %}", "append"),
        ("{% set ns = namespace(_secret=1) %}", "_secret"),
    ],
)
def test_templates_cannot_reach_python_internals(source: str, unsafe: str) -> None:
    with pytest.raises(ValueError, match=unsafe):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_continue_final_message_with_a_generation_prompt_is_a_value_error() -> None:
    template = ChatTemplate("{{ messages[-1]['content'] }}")
    with pytest.raises(ValueError, match=r"^continue_final_message: "):
        template.render([{"role": "assistant", "content": "a"}], continue_final_message=True)


def test_messages_passed_in_are_left_unchanged() -> None:
    messages = [{"role": "assistant", "content": [{"type": "text", "text": "a"}], "name": None}]
    before = json.dumps(messages)
    ChatTemplate("{{ messages[-1]['content'] }}").render(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert json.dumps(messages) == before
