"""Incremental detokenization with stop strings.

One `IncrementalDetokenizer` per request turns token ids into text as they arrive (tokenizers'
`DecodeStream`, primed with the prompt so the first output token gets its leading space right),
finds stop strings in the new text only, and holds back the last `len(longest stop) - 1`
characters of streamed text, since they might be the start of a stop string.

It keeps only the text not handed out yet and the tail of what was, never the whole output:
a step costs what its new text and the longest stop string cost, however long the output grows
(appending each step to the whole text made a 131k-token answer cost ~17 s of copying).

An update may bring several tokens (a verified run of speculative proposals): they are checked
one at a time, so a stop string ends the output at the token in which it completed, exactly as
if they had come one per step.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from triode.wire import SamplingParams

log = logging.getLogger(__name__)

# Prompt tokens fed to prime the stream: enough context for any merge across the boundary.
_PRIME_TOKENS = 8


class StopHit(NamedTuple):
    """A stop string that ended the output, and how many of the update's ids the output keeps:
    those up to and including the one in which the stop string completed."""

    stop: str
    kept: int


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._skip_special = params.skip_special_tokens
        self._prompt_tail = prompt_token_ids[-_PRIME_TOKENS:]
        self._stream = self._new_stream()
        self._stops = params.stop
        # how much text before the new text a stop string may start in
        self._reach = max((len(s) for s in self._stops), default=1) - 1
        self._hold = self._reach if self._stops and not params.include_stop_str_in_output else 0
        self._num_tokens = 0  # counted for `min_tokens`, so only where there are stops
        self._unsent = ""  # decoded, not handed out yet (the held-back tail among it)
        self._sent_tail = ""  # the last `_reach` characters handed out

    def _new_stream(self) -> DecodeStream:
        stream = DecodeStream(skip_special_tokens=self._skip_special)
        for tid in self._prompt_tail:
            stream.step(self._tokenizer, tid)
        return stream

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> StopHit | None:
        """Add tokens; return the stop string that ended the request, if one did, and how many
        of `new_token_ids` the output keeps (the rest are past the stop).

        `stop_terminated`: the engine stopped on a stop token (EOS or `stop_token_ids`), the
        last of `new_token_ids`, whose text is left out unless `include_stop_str_in_output`.
        Stop strings are looked for once the output has more than `min_tokens` tokens.
        """
        ids = new_token_ids
        if stop_terminated and not self._params.include_stop_str_in_output:
            ids = ids[:-1]
        if not self._stops:
            if len(ids) == 1:  # a decode step's
                self._unsent += self._step(ids[0])
            else:
                self._unsent += "".join([self._step(tid) for tid in ids])
            return None
        for kept, tid in enumerate(ids, 1):
            if (stop := self._add(tid)) is not None:
                return StopHit(stop, kept)
        return None

    def _add(self, token_id: int) -> str | None:
        """Add one token; return the stop string it completed, if it did."""
        new_from = len(self._sent_tail) + len(self._unsent)
        self._unsent += self._step(token_id)
        self._num_tokens += 1
        if self._num_tokens <= self._params.min_tokens:
            return None
        return self._find_stop(new_from)

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except Exception as e:  # a token the decoder cannot place: restart the stream
            log.debug("decode stream reset at token %d: %s", token_id, e)
            self._stream = self._new_stream()
            return self._tokenizer.decode([token_id], skip_special_tokens=self._skip_special)

    def _find_stop(self, new_from: int) -> str | None:
        """The first stop string that ends in the new text (from `new_from` of the sent tail
        and the unsent text); the text is cut at it."""
        text = self._sent_tail + self._unsent
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        cut = at + len(stop) if self._params.include_stop_str_in_output else at
        # what was sent is never cut: a stop string starts past it unless it is sent too
        self._unsent = text[len(self._sent_tail) : max(cut, len(self._sent_tail))]
        return stop

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, minus the held-back tail."""
        end = len(self._unsent) if finished else max(0, len(self._unsent) - self._hold)
        out, self._unsent = self._unsent[:end], self._unsent[end:]
        if self._reach and out:
            self._sent_tail = (self._sent_tail + out)[-self._reach :]
        return out
