"""Incremental detokenization with stop strings.

One `IncrementalDetokenizer` per request turns token ids into text as they arrive (tokenizers'
`DecodeStream`, primed with the prompt so the first output token gets its leading space right),
finds stop strings in the new text only, and holds back the last `len(longest stop) - 1`
characters of streamed text, since they might be the start of a stop string.
"""

from __future__ import annotations

import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from triode.wire import SamplingParams

log = logging.getLogger(__name__)

# Prompt tokens fed to prime the stream: enough context for any merge across the boundary.
_PRIME_TOKENS = 8


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
        self._hold = (
            max((len(s) for s in self._stops), default=1) - 1
            if self._stops and not params.include_stop_str_in_output
            else 0
        )
        self._num_tokens = 0
        self._sent = 0
        self.text = ""

    def _new_stream(self) -> DecodeStream:
        stream = DecodeStream(skip_special_tokens=self._skip_special)
        for tid in self._prompt_tail:
            stream.step(self._tokenizer, tid)
        return stream

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Add tokens; return the stop string that ended the request, if one did.

        `stop_terminated`: the engine stopped on a stop token (EOS or `stop_token_ids`), whose
        text is left out unless `include_stop_str_in_output`.
        """
        ids = new_token_ids
        if stop_terminated and not self._params.include_stop_str_in_output:
            ids = ids[:-1]
        start = len(self.text)
        for tid in ids:
            self.text += self._step(tid)
            self._num_tokens += 1
        if not self._stops or self._num_tokens <= self._params.min_tokens:
            return None
        return self._find_stop(start)

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except Exception as e:  # a token the decoder cannot place: restart the stream
            log.debug("decode stream reset at token %d: %s", token_id, e)
            self._stream = self._new_stream()
            return self._tokenizer.decode([token_id], skip_special_tokens=self._skip_special)

    def _find_stop(self, new_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop) if self._params.include_stop_str_in_output else at]
        return stop

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, minus the held-back tail."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent : end]
        self._sent = end
        return out
