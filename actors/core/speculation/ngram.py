"""Prompt lookup: the tokens that followed an earlier occurrence of the sequence's last n tokens.

For each request the proposer keeps the sequence (prompt, then output) and an index from each
`min_n`-gram to the positions where it ends, in increasing order; an appended token adds one
entry. `propose` looks up the last `min_n` tokens, extends each earlier occurrence backwards up
to `max_n` tokens, and copies what followed the best one: the longest match, and among equally
long matches the most recent one that is followed by `max_tokens` tokens (else the earliest,
which is followed by the most). vLLM takes the earliest; the most recent is the better guess
for what a model is copying now (a passage quoted twice, a line of code edited and repeated,
the latest turn of a conversation), but in a run of one token or a short cycle the most recent
occurrence ends just before the current position, with one or two tokens after it: there the
latest one with a whole proposal after it wins. Both rules agree whenever the longest match is
unique.

Cost: `start` and `extend` are O(1) per token. `propose` examines at most `MAX_CANDIDATES` of
the most recent occurrences (older ones are ignored: a 20,000-fold repeated token costs what a
1,024-fold one does), each over at most `max_n - min_n` further tokens, so it is
O(MAX_CANDIDATES * max_n) whatever the history. Memory is O(tokens) per request.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

# the most occurrences of the last min_n tokens that one proposal compares, the most recent first
MAX_CANDIDATES = 1024
# below this many candidates a Python loop beats numpy's per-call overhead
_VECTOR_THRESHOLD = 24


def append_tokens(tokens: list[int], array: np.ndarray, token_ids: Sequence[int]) -> np.ndarray:
    """Append `token_ids` to `tokens` and to its int64 mirror `array`, which doubles when it
    is full; returns the mirror (a new one when it grew)."""
    start = len(tokens)
    tokens.extend(int(t) for t in token_ids)
    end = len(tokens)
    if end > len(array):
        grown = np.empty(max(end, 2 * len(array)), dtype=np.int64)
        grown[:start] = array[:start]
        array = grown
    array[start:end] = tokens[start:end]
    return array


class _Sequence:
    """One request's tokens, as a list (for keys and slices) and an int64 array (for gathers),
    with the index from each min_n-gram to the positions where it ends."""

    __slots__ = ("array", "ends", "min_n", "tokens")

    def __init__(self, min_n: int) -> None:
        self.min_n = min_n
        self.tokens: list[int] = []
        self.array = np.empty(64, dtype=np.int64)
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        tokens = self.tokens
        start = len(tokens)
        self.array = append_tokens(tokens, self.array, token_ids)
        end = len(tokens)
        n = self.min_n
        ends = self.ends
        first = max(start, n - 1)
        if end <= first:
            return
        # the n-grams ending at first, first + 1, ...: zip builds the tuples without a Python loop
        grams = zip(*(tokens[first - n + 1 + j : end - n + 1 + j] for j in range(n)), strict=True)
        for i, key in enumerate(grams, first):
            positions = ends.get(key)
            if positions is None:
                ends[key] = [i]
            else:
                positions.append(i)


class NgramProposer:
    """Prompt-lookup proposals over each request's own prompt and output (see the module)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n
        self._requests: dict[str, _Sequence] = {}
        # candidate positions the last `propose` compared: the structural bound on its cost
        self.last_candidates = 0

    def start(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Begin a request with its prompt; ValueError when the id is already running."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already started")
        seq = _Sequence(self.min_n)
        seq.extend(prompt_token_ids)
        self._requests[request_id] = seq

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append output tokens; KeyError for a request not started."""
        self._requests[request_id].extend(token_ids)

    def stop(self, request_id: str) -> None:
        """Forget a request; unknown ids are ignored."""
        self._requests.pop(request_id, None)

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the best earlier match, or []."""
        self.last_candidates = 0
        seq = self._requests[request_id]
        tokens = seq.tokens
        length = len(tokens)
        if max_tokens <= 0 or length <= self.min_n:
            return []
        ends = seq.ends.get(tuple(tokens[length - self.min_n :]))
        # the last entry is the sequence's own end, which has nothing after it
        if ends is None or len(ends) < 2:
            return []
        candidates = ends[-MAX_CANDIDATES - 1 : -1]
        self.last_candidates = len(candidates)
        if self.max_n > self.min_n:
            if len(candidates) < _VECTOR_THRESHOLD:
                candidates = self._longest_scalar(tokens, candidates)
            else:
                candidates = self._longest_vector(seq.array[:length], candidates)
        # the latest that a whole proposal follows, else the earliest (the most follows it)
        i = bisect.bisect_right(candidates, length - 1 - max_tokens) - 1
        best = candidates[max(i, 0)]
        return tokens[best + 1 : best + 1 + max_tokens]

    def _longest_scalar(self, tokens: list[int], candidates: list[int]) -> list[int]:
        """The candidates with the longest match, in order, comparing token by token."""
        last = len(tokens) - 1
        reach = min(self.max_n, last)  # the suffix may not be longer than the sequence before it
        longest: list[int] = []
        best_n = -1
        for end in candidates:
            n = self.min_n
            while n < reach and end - n >= 0 and tokens[end - n] == tokens[last - n]:
                n += 1
            if n > best_n:
                longest, best_n = [end], n
            elif n == best_n:
                longest.append(end)
        return longest

    def _longest_vector(self, array: np.ndarray, candidates: list[int]) -> list[int]:
        """`_longest_scalar` over numpy arrays, one gather per extra token of match."""
        last = len(array) - 1
        ends = np.asarray(candidates, dtype=np.int64)
        matched = np.full(len(ends), self.min_n, dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for n in range(self.min_n, min(self.max_n, last)):
            back = ends - n
            alive &= back >= 0
            alive &= array[np.maximum(back, 0)] == array[last - n]
            if not alive.any():
                break
            matched += alive
        return ends[matched == matched.max()].tolist()
