"""The OpenAI logprob objects of chat and completions answers, built from the engine's token
logprobs: chat's `logprobs.content` entries and completions' parallel lists, for whole answers
and stream chunks alike.

With `return_tokens_as_token_ids` (vLLM's), each token, chosen or alternative, is named
`token_id:{id}` instead of by its text. What still speaks of the text keeps to it: chat's
`bytes` are the token's text's (vLLM gives an alternative the bytes of its `token_id:` name),
and completions' `text_offset` counts in the answer's text (vLLM counts the names' lengths).
"""

from __future__ import annotations

from triode.actors import CompletionOutput, Engine, TokenLogprob

from .generation import Prompt
from .request_bodies import CompletionRequest
from .response_bodies import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)

# Logprobs of -inf do not survive JSON; clamp them like vLLM does.
_MIN_LOGPROB = -9999.0


def chat_logprobs(
    engine: Engine, logprobs: list[TokenLogprob] | None, top: int, *, as_ids: bool = False
) -> ChatCompletionLogProbs | None:
    """A chat choice's `logprobs`: each token's, with its `top` alternatives (None: none
    asked for); each token named `token_id:{id}` with `as_ids`."""
    if logprobs is None:
        return None
    text = engine.intake.token_text
    name = _id_name if as_ids else text
    content = []
    for lp in logprobs:
        content.append(
            ChatCompletionLogProbsContent(
                token=name(lp.token_id),
                logprob=max(lp.logprob, _MIN_LOGPROB),
                bytes=list(text(lp.token_id).encode()),
                top_logprobs=[
                    ChatCompletionLogProb(
                        token=name(t),
                        logprob=max(v, _MIN_LOGPROB),
                        bytes=list(text(t).encode()),
                    )
                    for t, v in lp.top[:top]
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)


def completion_logprobs(
    engine: Engine,
    prompt: Prompt,
    choice: CompletionOutput,
    req: CompletionRequest,
    *,
    echo: bool,
    logprobs: list[TokenLogprob] | None = None,
    offset: int = 0,
) -> CompletionLogProbs | None:
    """A completion choice's `logprobs` (the prompt's first when it is echoed), its text
    offsets counted from `offset`; the choice's own logprobs unless `logprobs` are given (a
    stream's delta). None when the request asked for none. Tokens are named `token_id:{id}`
    when the request asks for `return_tokens_as_token_ids`."""
    if req.logprobs is None:
        return None
    entries: list[tuple[int, TokenLogprob | None]] = []
    if echo:
        first = prompt.token_ids[0]
        entries.append((first, None))
        entries += [(lp.token_id, lp) for lp in prompt.prompt_logprobs]
    source = choice.logprobs if logprobs is None else logprobs
    entries += [(lp.token_id, lp) for lp in source or ()]
    text = engine.intake.token_text
    as_ids = bool(req.return_tokens_as_token_ids)
    name = _id_name if as_ids else text
    out = CompletionLogProbs()
    for token_id, lp in entries:
        shown = text(token_id)
        token = _id_name(token_id) if as_ids else shown
        out.text_offset.append(offset)
        offset += len(shown)
        out.tokens.append(token)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(max(lp.logprob, _MIN_LOGPROB))
        top = {name(t): max(v, _MIN_LOGPROB) for t, v in lp.top[: req.logprobs]}
        top.setdefault(token, max(lp.logprob, _MIN_LOGPROB))
        out.top_logprobs.append(top)
    return out


def _id_name(token_id: int) -> str:
    return f"token_id:{token_id}"
