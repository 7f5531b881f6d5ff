"""The incremental detokenizer: stop strings found where the whole text would show them, text
held back while it may start one, only a bounded tail kept however long the output, and tokens
that come several at once ending where they would have one at a time."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from triode.actors.detokenizer import IncrementalDetokenizer
from triode.wire import SamplingParams

PIECES = ["<unk>", "a", "b", "c", "x", " ", ".", "ab", "ba", "cab", "\n"]


def piece_tokenizer() -> Tokenizer:
    """A tokenizer whose tokens are `PIECES` and whose text is the pieces, joined."""
    vocab = {piece: i for i, piece in enumerate(PIECES)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.decoder = decoders.Fuse()
    return t


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return piece_tokenizer()


def run(
    tokenizer: Tokenizer, ids: list[int], params: SamplingParams, step: int = 1
) -> tuple[str, str | None, list[str], int]:
    """(text handed out, stop string, the deltas, tokens kept) for `ids` coming `step` at a
    time."""
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas: list[str] = []
    for i in range(0, len(ids), step):
        hit = detok.update(ids[i : i + step])
        deltas.append(detok.delta(hit is not None))
        if hit is not None:
            return "".join(deltas), hit.stop, deltas, i + hit.kept
    deltas.append(detok.delta(True))
    return "".join(deltas), None, deltas, len(ids)


def reference(ids: list[int], params: SamplingParams) -> tuple[str, str | None, int]:
    """The same answer from the whole text, searched again after every token."""
    text = ""
    for n, token in enumerate(ids, 1):
        new_from = len(text)
        text += PIECES[token]
        if n <= params.min_tokens:
            continue
        found = [
            (at, stop)
            for stop in params.stop
            if (at := text.find(stop, max(0, new_from - len(stop) + 1))) != -1
        ]
        if found:
            at, stop = min(found, key=lambda f: f[0])  # on a tie, the first in `stop`
            return text[: at + len(stop) if params.include_stop_str_in_output else at], stop, n
    return text, None, len(ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_stop_strings_match_a_search_of_the_whole_text_after_each_token(
    tokenizer: Tokenizer, include: bool, step: int
) -> None:
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(1, len(PIECES)) for _ in range(rng.randrange(1, 40))]
        stops = rng.sample(["ab", "cab", "b.", "x x", "ba\n", "c", "aaaa", "abcab"], 2)
        params = SamplingParams(
            stop=stops, include_stop_str_in_output=include, min_tokens=rng.choice([0, 0, 3, 7])
        )
        text, stop, _, kept = run(tokenizer, ids, params, step)
        assert (text, stop, kept) == reference(ids, params), (ids, stops)


def test_a_stop_string_that_ends_first_wins_over_one_that_starts_first(
    tokenizer: Tokenizer,
) -> None:
    # one token at a time, "b." is complete before "abcab" is; so it is in one update of all
    ids = [PIECES.index(p) for p in ["x", "a", "b", ".", "c", "ab"]]
    params = SamplingParams(stop=["xab.cab", "b."])
    for step in (1, len(ids)):
        text, stop, _, kept = run(tokenizer, ids, params, step)
        assert (text, stop, kept) == ("xa", "b.", 4)


def test_a_stream_never_hands_out_what_may_start_a_stop_string(tokenizer: Tokenizer) -> None:
    ids = [PIECES.index(p) for p in ["x", "a", "b", "c", "a", "b", "x"]]
    text, stop, deltas, _ = run(tokenizer, ids, SamplingParams(stop=["cabx"]))
    assert (text, stop) == ("xab", "cabx")
    assert all("c" not in d for d in deltas)  # "c" was held back, then cut with the stop


def test_only_a_bounded_tail_is_kept_however_long_the_output(tokenizer: Tokenizer) -> None:
    params = SamplingParams(stop=["q" * 20, "never"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    handed_out = 0
    for _ in range(200_000):
        assert detok.update([PIECES.index("cab")]) is None
        handed_out += len(detok.delta(False))
        # what it keeps: the held-back text and the tail a stop string may start in
        assert len(detok._unsent) + len(detok._sent_tail) <= 2 * 19 + 3
    assert handed_out + len(detok.delta(True)) == 3 * 200_000
