"""The intake refuses text that is not valid Unicode with ValueError, like any other bad input."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from triode.actors.chat_template import ChatTemplate
from triode.actors.intake import OFFLOAD_CHARS, Intake

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _intake() -> Intake:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return Intake(tokenizer, ChatTemplate(TEMPLATE))


# Lone surrogates: what bytes decoded with surrogateescape carry in place of invalid UTF-8.
LONE = ["\udcff", "a\ud800b", "x" * OFFLOAD_CHARS + "\udfff"]


@pytest.mark.parametrize("text", LONE, ids=["escape", "high", "offloaded"])
async def test_a_lone_surrogate_in_a_prompt_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        await _intake().encode(text)


@pytest.mark.parametrize("text", LONE, ids=["escape", "high", "offloaded"])
async def test_a_lone_surrogate_in_a_message_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        await _intake().encode_chat([{"role": "user", "content": text}])


async def test_template_syntax_in_a_message_is_text() -> None:
    content = "{{ 7*7 }} {% for x in range(3) %}x{% endfor %}"

    text, ids = await _intake().encode_chat([{"role": "user", "content": content}])

    assert text == "<user>" + content
    assert ids
