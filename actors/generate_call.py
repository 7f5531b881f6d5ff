"""One `Engine.generate` call in the engine client: its `n` child requests, each with its own
sampling parameters (`split_params`) and detokenizer, and the `RequestOutput`s assembled from
what the engine core sends back for them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from triode.wire import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from triode.wire.tensor_ipc import TensorHandle

from .core_client import EngineCoreClient, RequestStream
from .detokenizer import IncrementalDetokenizer
from .errors import RequestError, RequestRefused
from .outputs import CompletionOutput, RequestOutput, token_logprobs

if TYPE_CHECKING:
    from .engine import Engine

# The largest seed `SamplingParams` takes (and the negation of the smallest).
_MAX_SEED = 2**63 - 1


class GenerateCall:
    """One `generate` call: its child requests (n of them), their detokenizers and results."""

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prompt: str | list[int] | None,
        prompt_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        embeds: list[TensorHandle] | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.engine = engine
        self.kv_transfer_params = kv_transfer_params
        self.embeds = embeds or []  # one shared copy of the prompt embeddings per child
        self.cache_salt = cache_salt
        self.lora_name = lora_name  # the adapter every child runs with
        self.stream = RequestStream()
        self.params = params
        self.prompt_ids = prompt_ids
        self.output = RequestOutput(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_ids,
            [
                CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)
            ],
        )
        if params.prompt_logprobs is not None:
            self.output.prompt_logprobs = []
        child_params = split_params(with_eos_ids(params, engine.extra_eos_token_ids))
        self.child_ids = (
            [request_id] if params.n == 1 else [f"{request_id}/{i}" for i in range(params.n)]
        )
        self.index = {cid: i for i, cid in enumerate(self.child_ids)}
        self.child_params = child_params
        context = [] if self.embeds else prompt_ids  # placeholders are no text to go on
        self.detokenizers = [
            IncrementalDetokenizer(engine.tokenizer, context, p) for p in child_params
        ]
        self._stopped: list[str] = []
        # each completion's text in the pieces it came in, joined when handed out: appending
        # each step's piece to one string would copy the whole text every step
        self._texts: list[list[str]] = [[] for _ in range(params.n)]
        # (text pieces, token ids, logprobs) already handed out
        self._marks = [(0, 0, 0)] * params.n
        self._prompt_mark = 0
        self._told_ended: set[int] = set()  # the choices whose end a delta told

    async def start(self, client: EngineCoreClient) -> None:
        now = time.time()
        for i, (cid, p) in enumerate(zip(self.child_ids, self.child_params, strict=True)):
            request = EngineCoreRequest(
                cid,
                self.prompt_ids,
                p,
                self.engine.eos_token_id,
                arrival_time=now,
                kv_transfer_params=self.kv_transfer_params,
                prompt_embeds=self.embeds[i] if self.embeds else None,
                cache_salt=self.cache_salt,
                lora_name=self.lora_name,
            )
            await client.add_request(request, self.stream)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.output.outputs)

    def take(self, out: EngineCoreOutput) -> None:
        i = self.index.get(out.request_id)
        if i is None:
            return
        completion = self.output.outputs[i]
        if completion.finished:
            return  # e.g. a token that was in flight when a stop string ended it
        if out.finish_reason is FinishReason.ERROR:
            raise RequestError(str(out.stop_reason or "the engine failed the request"))
        if out.finish_reason is FinishReason.REFUSED:
            raise RequestRefused(str(out.stop_reason or "the engine is busy"))
        if out.num_cached_tokens:
            self.output.num_cached_tokens = out.num_cached_tokens
        if out.new_token_ids:
            self.output.weight_version = out.weight_version
        if out.kv_transfer_params is not None:
            self.output.kv_transfer_params = out.kv_transfer_params
        if out.new_prompt_logprobs is not None and self.output.prompt_logprobs is not None:
            self.output.prompt_logprobs.extend(token_logprobs(out.new_prompt_logprobs))
        on_stop_token = out.finish_reason is FinishReason.STOP and not isinstance(
            out.stop_reason, str
        )
        detok = self.detokenizers[i]
        hit = detok.update(out.new_token_ids, stop_terminated=on_stop_token)
        # several tokens at once (verified speculation) keep only those up to the stop string's
        new_ids = out.new_token_ids if hit is None else out.new_token_ids[: hit.kept]
        completion.token_ids.extend(new_ids)
        if out.new_logprobs is not None and completion.logprobs is not None:
            rows = token_logprobs(out.new_logprobs)
            completion.logprobs.extend(rows if hit is None else rows[: hit.kept])
        if hit is not None:
            completion.finish_reason, completion.stop_reason = "stop", hit.stop
            self._stopped.append(out.request_id)
        elif out.finish_reason is not None:
            completion.finish_reason = str(out.finish_reason)
            completion.stop_reason = out.stop_reason
        if piece := detok.delta(completion.finished):
            self._texts[i].append(piece)

    def stopped_by_string(self) -> list[str]:
        stopped, self._stopped = self._stopped, []
        return stopped

    def snapshot(self, delta: bool) -> RequestOutput:
        """The output so far, or with `delta` what was added since the last snapshot."""
        out = self.output
        out.finished = self.finished
        marks = self._marks if delta else [(0, 0, 0)] * len(out.outputs)
        # a delta tells a choice's end once: a choice that ended before (of n > 1) says nothing
        told = self._told_ended if delta else set()
        completions = [
            CompletionOutput(
                c.index,
                "".join(self._texts[c.index][text:]),
                c.token_ids[tokens:],
                None if c.index in told else c.finish_reason,
                None if c.index in told else c.stop_reason,
                None if c.logprobs is None else c.logprobs[logprobs:],
            )
            for c, (text, tokens, logprobs) in zip(out.outputs, marks, strict=True)
        ]
        if delta:
            told.update(c.index for c in out.outputs if c.finish_reason is not None)
        prompt_logprobs = out.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[self._prompt_mark if delta else 0 :]
        if delta:
            self._marks = [
                (len(self._texts[c.index]), len(c.token_ids), len(c.logprobs or ()))
                for c in out.outputs
            ]
            self._prompt_mark = len(out.prompt_logprobs or ())
        return RequestOutput(
            out.request_id,
            out.prompt,
            out.prompt_token_ids,
            completions,
            out.finished,
            out.num_cached_tokens,
            prompt_logprobs,
            out.kv_transfer_params,
            out.weight_version,
        )

    def unfinished_ids(self) -> list[str]:
        return [
            cid
            for cid, c in zip(self.child_ids, self.output.outputs, strict=True)
            if not c.finished
        ]


def with_eos_ids(params: SamplingParams, eos_ids: list[int]) -> SamplingParams:
    """`params` stopping also on the model's other end-of-sequence ids, unless it ignores EOS."""
    extra = [t for t in eos_ids if t not in params.stop_token_ids]
    if params.ignore_eos or not extra:
        return params
    return msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])


def split_params(params: SamplingParams) -> list[SamplingParams]:
    """The parameters of each of a request's `n` sequences: `n=1`, and seeds `seed + i`.

    A seed near the top of the range wraps around to its bottom rather than overflowing it, so
    every sequence gets a distinct seed that the engine core accepts.
    """
    if params.seed is None:
        return [msgspec.structs.replace(params, n=1) for _ in range(params.n)]
    span = 2 * _MAX_SEED + 1
    return [
        msgspec.structs.replace(params, n=1, seed=(params.seed + i + _MAX_SEED) % span - _MAX_SEED)
        for i in range(params.n)
    ]
