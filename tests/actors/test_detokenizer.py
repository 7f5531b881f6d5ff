"""The incremental detokenizer: stop strings found where the whole text would show them, text
held back while it may start one, and only a bounded tail kept however long the output."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from triode.actors.detokenizer import IncrementalDetokenizer
from triode.wire import SamplingParams

PIECES = ["<unk>", "a", "b", "c", "x", " ", ".", "ab", "ba", "cab", "\n"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    vocab = {piece: i for i, piece in enumerate(PIECES)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.decoder = decoders.Fuse()  # the text is the pieces, joined
    return t


def run(
    tokenizer: Tokenizer, ids: list[int], params: SamplingParams, step: int = 1
) -> tuple[str, str | None, list[str]]:
    """(text handed out, stop string, the deltas) for `ids` coming `step` at a time."""
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas: list[str] = []
    for i in range(0, len(ids), step):
        stop = detok.update(ids[i : i + step])
        deltas.append(detok.delta(stop is not None))
        if stop is not None:
            return "".join(deltas), stop, deltas
    deltas.append(detok.delta(True))
    return "".join(deltas), None, deltas


def reference(ids: list[int], params: SamplingParams, step: int = 1) -> tuple[str, str | None]:
    """The same answer from the whole text, searched again after every update."""
    text = ""
    for n, i in enumerate(range(0, len(ids), step)):
        new_from = len(text)
        text += "".join(PIECES[t] for t in ids[i : i + step])
        if min(len(ids), (n + 1) * step) <= params.min_tokens:
            continue
        found = [
            (at, stop)
            for stop in params.stop
            if (at := text.find(stop, max(0, new_from - len(stop) + 1))) != -1
        ]
        if found:
            at, stop = min(found, key=lambda f: f[0])  # on a tie, the first in `stop`
            return text[: at + len(stop) if params.include_stop_str_in_output else at], stop
    return text, None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("step", [1, 3])
def test_stop_strings_match_a_search_of_the_whole_text(
    tokenizer: Tokenizer, include: bool, step: int
) -> None:
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(1, len(PIECES)) for _ in range(rng.randrange(1, 40))]
        stops = rng.sample(["ab", "cab", "b.", "x x", "ba\n", "c", "aaaa", "abcab"], 2)
        params = SamplingParams(
            stop=stops, include_stop_str_in_output=include, min_tokens=rng.choice([0, 0, 3])
        )
        text, stop, _ = run(tokenizer, ids, params, step)
        assert (text, stop) == reference(ids, params, step), (ids, stops)


def test_a_stream_never_hands_out_what_may_start_a_stop_string(tokenizer: Tokenizer) -> None:
    ids = [PIECES.index(p) for p in ["x", "a", "b", "c", "a", "b", "x"]]
    text, stop, deltas = run(tokenizer, ids, SamplingParams(stop=["cabx"]))
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
