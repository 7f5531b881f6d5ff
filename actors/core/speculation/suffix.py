"""Suffix decoding (SuffixDecoding, arXiv 2411.04975, as Arctic Inference runs it), over token
arrays instead of suffix trees.

Two sources answer each proposal: the request's own prompt and output ("local"), and the
outputs of recent requests, running ones included ("global"). In a source, the occurrences of
the sequence's last m tokens (m = 1, 2, ... while they occur, m < `max_tree_depth`) propose a
path: the most frequent next token among the occurrences' continuations, again and again, each
step multiplying an estimated probability by (that token's count / the occurrences' count,
those without a continuation included); the path stops before a token whose probability would
fall below `min_token_prob`, after min(max_tokens, floor(m * max_spec_factor)) tokens, or where
match and path together would pass `max_tree_depth` (the tree's depth). Its score is the sum of
its tokens' probabilities; the best score over all m and both sources wins, ties going to the
longer match and then to the local source. A suffix trie gives the occurrences by walking its
nodes; here an index from the last token and from the last `SEED_N` tokens gives them as
positions, and each further token of match filters those positions (one numpy gather).

Where this differs from the trie: the most frequent continuations tie towards the most recent
occurrence; a match draws on the `MAX_OCCURRENCES` most recent occurrences of its last token or
of its last `SEED_N` tokens, so counts over a token repeated more often than that are
estimates from its recent uses, and this is what bounds the cost; and the global source keeps
at most `global_capacity(max_cached_requests)` tokens (`TOKENS_PER_CACHED_OUTPUT` per cached
request, at most `MAX_GLOBAL_TOKENS`), the oldest tokens going first, besides the FIFO of
`max_cached_requests` outputs.

Cost: `start` and `extend` are O(1) per token (global sweeps, every `global_capacity` tokens,
are O(capacity)). `propose` touches at most `examined_bound(max_tokens)` positions whatever the
history; matches whose best possible score cannot beat the best found are not followed.
Memory is O(tokens) per request and O(global capacity) shared.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np

from .config import SpeculativeConfig
from .ngram import append_tokens

# a match draws on at most this many of the most recent occurrences of its seed
MAX_OCCURRENCES = 256
# matches of at least this many tokens are seeded by their last SEED_N tokens, shorter ones by
# their last token
SEED_N = 4

# a cached output contributes at most this many tokens to the global source's capacity
TOKENS_PER_CACHED_OUTPUT = 1024
MAX_GLOBAL_TOKENS = 1 << 19
# below this many occurrences a match is extended one by one rather than over arrays
_SMALL = 12


_EMPTY = np.empty(0, dtype=np.int64)


class LocalSource:
    """A request's prompt and output; a position is an index into it."""

    __slots__ = ("array", "grams", "last", "tokens")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.tokens: list[int] = []
        self.array = np.empty(64, dtype=np.int64)
        self.last: dict[int, list[int]] = {}  # token -> the positions where it is
        self.grams: dict[tuple[int, ...], list[int]] = {}  # SEED_N tokens -> where they end
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        tokens = self.tokens
        start = len(tokens)
        self.array = append_tokens(tokens, self.array, token_ids)
        end = len(tokens)
        for i in range(start, end):
            _add(self.last, tokens[i], i)
        first = max(start, SEED_N - 1)
        if end <= first:
            return
        # the SEED_N-grams ending at first, first + 1, ...: zip builds the tuples
        shifted = (tokens[first - SEED_N + 1 + j : end - SEED_N + 1 + j] for j in range(SEED_N))
        for i, key in enumerate(zip(*shifted, strict=True), first):
            _add(self.grams, key, i)

    def seed(self, key: int | tuple[int, ...]) -> np.ndarray:
        """The most recent positions where `key` (a token, or SEED_N of them) ends."""
        positions = (self.grams if isinstance(key, tuple) else self.last).get(key)
        if not positions:
            return _EMPTY
        return np.array(positions[-MAX_OCCURRENCES:], dtype=np.int64)

    def match_lengths(
        self, ends: np.ndarray, reverse: list[int], first: int, last: int
    ) -> np.ndarray:
        """How many tokens, at most `last`, of `reverse` (the context, last token first) occur
        ending at each of `ends`, whose first `first` are known to."""
        behind = ends[:, None] - np.arange(first, last)[None, :]
        same = self.array[np.maximum(behind, 0)] == np.array(reverse[first:last])
        same &= behind >= 0
        return first + np.cumprod(same, axis=1).sum(axis=1)

    def forward(self, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens after `ends` (-1 at the end) and their positions."""
        after = ends + 1
        n = len(self.tokens)
        return np.where(after < n, self.array[np.minimum(after, n - 1)], -1), after

    def follow(self, end: int, count: int) -> list[int]:
        """Up to `count` tokens after position `end`."""
        return self.tokens[end + 1 : end + 1 + count]


class GlobalSource:
    """Recent requests' outputs, interleaved as they are generated in one ring of `capacity`
    token slots; a position is the running number of a token (its slot: modulo the ring's
    size), and each token links to the one before and after it in its output. Outputs are
    numbered as they start; the oldest leave past `max_outputs` (positions of outputs numbered
    below `first_alive` are ignored), and the oldest tokens leave past `capacity` (positions
    below `count - size` are overwritten)."""

    __slots__ = (
        "after",
        "before",
        "capacity",
        "count",
        "ends",
        "first_alive",
        "grams",
        "last",
        "max_outputs",
        "opened",
        "output",
        "swept",
        "tails",
        "token_at",
    )

    def __init__(self, max_outputs: int, capacity: int) -> None:
        self.max_outputs = max_outputs
        self.capacity = capacity
        size = min(capacity, 4096)
        self.token_at = np.empty(size, dtype=np.int64)
        self.before = np.empty(size, dtype=np.int64)
        self.after = np.empty(size, dtype=np.int64)
        self.output = np.empty(size, dtype=np.int64)
        self.count = 0
        self.swept = 0
        self.opened = 0
        self.first_alive = 0
        self.last: dict[int, list[int]] = {}
        self.grams: dict[tuple[int, ...], list[int]] = {}
        self.tails: dict[int, list[int]] = {}  # running output -> its last SEED_N tokens
        self.ends: dict[int, int] = {}  # running output -> the position of its last token

    def open(self) -> int:
        """Number a new output, evicting the oldest past `max_outputs`."""
        number = self.opened
        self.opened += 1
        self.first_alive = max(self.first_alive, self.opened - self.max_outputs)
        while self.tails and (oldest := next(iter(self.tails))) < self.first_alive:
            del self.tails[oldest], self.ends[oldest]
        self.tails[number] = []
        self.ends[number] = -1
        return number

    def close(self, number: int) -> None:
        """Output `number` is complete: its tokens stay until evicted, but what appending to it
        needs goes now, so that this bookkeeping is kept for running outputs only and not for
        every one of the last `max_outputs`. Idempotent."""
        self.tails.pop(number, None)
        self.ends.pop(number, None)

    def append(self, number: int, token_ids: Sequence[int]) -> None:
        """Add tokens to output `number`; ignored once it has been evicted or closed."""
        tail = self.tails.get(number)
        if tail is None:
            return
        previous = self.ends[number]
        for t in token_ids:
            token = int(t)
            position = self.count
            if position >= len(self.token_at) and len(self.token_at) < self.capacity:
                self._grow()
            size = len(self.token_at)
            slot = position % size
            self.token_at[slot] = token
            self.before[slot] = previous
            self.after[slot] = -1
            self.output[slot] = number
            if previous > position - size:
                self.after[previous % size] = position
            _add(self.last, token, position)
            tail.append(token)
            if len(tail) > SEED_N:
                del tail[0]
            if len(tail) == SEED_N:
                _add(self.grams, tuple(tail), position)
            previous = position
            self.count = position + 1
        self.ends[number] = previous
        if self.count - self.swept >= self.capacity:
            self._sweep()

    def _grow(self) -> None:
        size = min(self.capacity, 2 * len(self.token_at))
        for name in ("token_at", "before", "after", "output"):
            old = getattr(self, name)
            new = np.empty(size, dtype=np.int64)
            new[: len(old)] = old
            setattr(self, name, new)

    def _sweep(self) -> None:
        """Drop index entries for overwritten slots, so the index stays O(capacity)."""
        low = self.count - len(self.token_at)
        for index in (self.last, self.grams):
            for key in list(index):
                _trim(index, key, low)
        self.swept = self.count

    def seed(self, key: int | tuple[int, ...]) -> np.ndarray:
        """The most recent live positions where `key` (a token, or SEED_N of them) ends. The
        index is read, never trimmed here: dropping a list's overwritten head moves the whole
        list, `capacity` positions for a token that fills the ring, at every proposal; the
        sweep drops them once every `capacity` tokens."""
        index = self.grams if isinstance(key, tuple) else self.last
        positions = index.get(key)
        if not positions:
            return _EMPTY
        ends = np.array(positions[-MAX_OCCURRENCES:], dtype=np.int64)
        ends = ends[ends >= self.count - len(self.token_at)]
        return ends[self.output[ends % len(self.token_at)] >= self.first_alive]

    def match_lengths(
        self, ends: np.ndarray, reverse: list[int], first: int, last: int
    ) -> np.ndarray:
        """`LocalSource.match_lengths`, one step back along the outputs' links at a time: over
        arrays while many occurrences still match, then one by one."""
        size = len(self.token_at)
        low = max(self.count - size, 0)
        lengths = np.full(len(ends), first, dtype=np.int64)
        cursor = ends
        for _ in range(first - 1):
            cursor = np.where(cursor >= low, self.before[cursor % size], -1)
        alive = np.arange(len(ends))
        j = first
        while j < last and len(alive) > _SMALL:
            cursor = np.where(cursor >= low, self.before[cursor % size], -1)
            keep = (cursor >= low) & (self.token_at[cursor % size] == reverse[j])
            alive, cursor = alive[keep], cursor[keep]
            lengths[alive] += 1
            j += 1
        for i, position in zip(alive.tolist(), cursor.tolist(), strict=True):
            k = j
            while k < last and position >= low:
                position = int(self.before[position % size])
                if position < low or int(self.token_at[position % size]) != reverse[k]:
                    break
                k += 1
            lengths[i] = k
        return lengths

    def forward(self, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens after `ends` in their outputs (-1 where none yet) and their positions."""
        size = len(self.token_at)
        after = self.after[ends % size]
        return np.where(after >= 0, self.token_at[after % size], -1), after

    def follow(self, end: int, count: int) -> list[int]:
        """Up to `count` tokens after position `end` in its output."""
        size = len(self.token_at)
        out: list[int] = []
        position = end
        while len(out) < count:
            position = int(self.after[position % size])
            if position < 0:
                break
            out.append(int(self.token_at[position % size]))
        return out


Source = LocalSource | GlobalSource


def _add(index: dict, key: int | tuple[int, ...], position: int) -> None:
    positions = index.get(key)
    if positions is None:
        index[key] = [position]
    else:
        positions.append(position)


def _trim(index: dict, key: int | tuple[int, ...], low: int) -> list[int] | None:
    """The key's positions without those below `low` (dropping the key when none is left)."""
    positions = index.get(key)
    if positions and positions[0] < low:
        del positions[: bisect.bisect_left(positions, low)]
        if not positions:
            del index[key]
    return positions


def global_capacity(max_cached_requests: int) -> int:
    """Tokens the global source keeps for `max_cached_requests` cached outputs."""
    return min(max(max_cached_requests, 1) * TOKENS_PER_CACHED_OUTPUT, MAX_GLOBAL_TOKENS)


class SuffixProposer:
    """Suffix-decoding proposals from a request's own tokens and recent outputs (see module)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        cached = config.suffix_decoding_max_cached_requests
        self._local: dict[str, LocalSource] = {}
        self._outputs: dict[str, int] = {}  # running request -> its output's number in global
        self._global = GlobalSource(cached, global_capacity(cached)) if cached else None
        # positions the last `propose` touched: never more than `examined_bound(max_tokens)`
        self.last_examined = 0

    def examined_bound(self, max_tokens: int) -> int:
        """The most positions one `propose` touches: per source, two seeds of at most
        MAX_OCCURRENCES positions, each filtered once per match length and each match's path
        stepping at most max_tokens times."""
        return 2 * 2 * MAX_OCCURRENCES * self.depth * (max_tokens + 1)

    def start(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Begin a request; its output joins the global source (evicting the oldest output past
        `max_cached_requests`). ValueError when the id is already running."""
        if request_id in self._local:
            raise ValueError(f"request {request_id!r} already started")
        self._local[request_id] = LocalSource(prompt_token_ids)
        if self._global is not None:
            self._outputs[request_id] = self._global.open()

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append output tokens; KeyError for a request not started."""
        self._local[request_id].extend(token_ids)
        if self._global is not None:
            self._global.append(self._outputs[request_id], token_ids)

    def stop(self, request_id: str) -> None:
        """The request ended: its own tokens go, its output stays cached. Unknown ids ignored."""
        self._local.pop(request_id, None)
        number = self._outputs.pop(request_id, None)
        if number is not None and self._global is not None:
            self._global.close(number)

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        """The best-scoring path of up to `max_tokens` tokens, or []."""
        local = self._local[request_id]
        self.last_examined = 0
        if max_tokens <= 0:
            return []
        context = local.tokens[-self.depth :]
        limits = [self._limit(m, max_tokens) for m in range(self.depth + 1)]
        best = _Draft()
        for source in (local, self._global):
            if source is not None:
                draft = self._draft(source, context, limits, best)
                if (draft.score, draft.match) > (best.score, best.match):
                    best = draft
        return best.tokens

    def _limit(self, match: int, max_tokens: int) -> int:
        """How many tokens a match of `match` tokens may propose."""
        by_factor = int(match * self.spec_factor + 1e-6)
        return max(0, min(max_tokens, by_factor, self.depth - match))

    def _draft(self, source: Source, context: list[int], limits: list[int], best: _Draft) -> _Draft:
        """The best draft of one source that beats `best`, else an empty one. Matches of at
        least SEED_N tokens come first, so that shorter ones, seeded by the last token alone,
        are followed only where their limit could beat what the longer ones found."""
        longest = len(context) - 1
        reverse = context[::-1]
        seeds = []
        if longest >= SEED_N:
            seeds.append((SEED_N, longest, tuple(context[-SEED_N:])))
        if longest >= 1:
            seeds.append((1, min(SEED_N - 1, longest), context[-1]))
        found = floor = best
        for first, last, key in seeds:
            if max(limits[first : last + 1]) <= floor.score:
                continue
            ends = source.seed(key)
            if len(ends) == 0:
                continue
            self.last_examined += len(ends) * max(last - first, 1)
            lengths = source.match_lengths(ends, reverse, first, last)
            for draft in self._follow(source, ends, lengths, first, limits, floor):
                found = floor = draft
        return found if found is not best else _Draft()

    def _follow(
        self,
        source: Source,
        ends: np.ndarray,
        lengths: np.ndarray,
        first: int,
        limits: list[int],
        floor: _Draft,
    ) -> Iterator[_Draft]:
        """Drafts that beat `floor`, each beating the one before, longest matches first. The
        match lengths between two consecutive values of `lengths` share one set of
        occurrences, hence one path, cut at each length's limit."""
        distinct = sorted(set(lengths.tolist()), reverse=True)
        for i, longest in enumerate(distinct):
            shortest = distinct[i + 1] + 1 if i + 1 < len(distinct) else first
            matches = range(longest, shortest - 1, -1)
            top = max(limits[m] for m in matches)
            if top == 0 or top <= floor.score:
                continue
            tokens, probs = self._path(source, ends[lengths >= longest], top)
            prefix = [0.0, *itertools.accumulate(probs)]
            for m in matches:
                n = min(limits[m], len(tokens))
                if n and (prefix[n], m) > (floor.score, floor.match):
                    floor = _Draft(prefix[n], m, tokens[:n])
                    yield floor

    def _path(self, source: Source, ends: np.ndarray, limit: int) -> tuple[list[int], list[float]]:
        """Up to `limit` most frequent continuations of the occurrences ending at `ends`, with
        their estimated probabilities, stopping below `min_prob`."""
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        while len(tokens) < limit:
            if len(ends) == 1:
                # one occurrence: every further step has probability ratio 1
                tokens.extend(source.follow(int(ends[0]), limit - len(tokens)))
                probs.extend([prob] * (len(tokens) - len(probs)))
                break
            self.last_examined += len(ends)
            following, after = source.forward(ends)
            token, count = _most_frequent(following)
            if count == 0:
                break
            prob *= count / len(ends)
            if prob < self.min_prob:
                break
            tokens.append(token)
            probs.append(prob)
            ends = after[following == token]
        return tokens, probs


class _Draft:
    """A proposal, its score, and the match length that made it."""

    __slots__ = ("match", "score", "tokens")

    def __init__(self, score: float = 0.0, match: int = 0, tokens: list[int] | None = None):
        self.score = score
        self.match = match
        self.tokens = tokens or []


def _most_frequent(following: np.ndarray) -> tuple[int, int]:
    """The most frequent non-negative token and its count, ties to the last one to occur;
    (-1, 0) when there is none. At most MAX_OCCURRENCES tokens: Python's counter is quicker
    here than numpy's sorting."""
    tokens = following.tolist()
    counts = Counter(tokens)
    counts.pop(-1, None)
    if not counts:
        return -1, 0
    top = max(counts.values())
    return next(t for t in reversed(tokens) if counts.get(t) == top), top
