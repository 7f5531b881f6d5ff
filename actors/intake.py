"""The intake: chat templates and tokenization, before a request is built for the engine.

Rendering and tokenizing are CPU work proportional to the input; inputs above
`OFFLOAD_CHARS` run in a worker thread so one huge prompt never stalls the event loop (and so
every other stream) for its whole duration.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import trio
from tokenizers import Tokenizer

from .chat_template import ChatTemplate

OFFLOAD_CHARS = 16_384

_T = TypeVar("_T")


class Intake:
    """Turns text and chat messages into token ids for one model."""

    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def from_model_dir(cls, tokenizer: Tokenizer, model_dir: Path) -> Intake:
        try:
            template = ChatTemplate.from_model_dir(model_dir)
        except ValueError:
            template = None  # a base model: completions only
        return cls(tokenizer, template)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await _maybe_offload(
            len(text), lambda: self.encode_now(text, add_special_tokens=add_special_tokens)
        )

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """(prompt text, token ids) for a conversation. Raises ValueError when the model has no
        chat template, the template refuses the messages, or the text is not valid Unicode."""
        template = self.chat_template
        if template is None:
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        reserved = {"messages", "add_generation_prompt", "continue_final_message"}
        clash = sorted(reserved & set(template_kwargs or ()))
        if clash:
            raise ValueError(f"chat_template_kwargs: may not set {', '.join(clash)}")
        for i, message in enumerate(messages):
            if message.get("content") is None and message.get("role") != "assistant":
                raise ValueError(
                    f"messages[{i}].content: a {message.get('role')} message needs content"
                )
        size = sum(len(str(m.get("content") or "")) for m in messages)

        def work() -> tuple[str, list[int]]:
            text = template.render(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
            return text, self.encode_now(text, add_special_tokens=add_special_tokens)

        return await _maybe_offload(size, work)

    async def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return await _maybe_offload(
            len(token_ids) * 4,
            lambda: self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens),
        )

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one Intake per engine, lives as long
    def token_text(self, token_id: int) -> str:
        """One token's text as it would print (for logprobs)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode_now(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """`encode` in the calling thread. Raises ValueError for text that is not valid Unicode."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            # tokenizers takes only valid Unicode: a str with a lone surrogate (bytes decoded
            # with surrogateescape, say) is bad input, like any other.
            if not isinstance(text, str):
                raise
            raise ValueError("the text is not valid Unicode (it holds a lone surrogate)") from None


async def _maybe_offload(size: int, work: Callable[[], _T]) -> _T:
    if size > OFFLOAD_CHARS:
        return await trio.to_thread.run_sync(work)
    return work()
