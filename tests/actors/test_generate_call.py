"""A call's outputs when the engine core sends several tokens of a request at once (a verified
run of speculative proposals): text, token ids, logprobs and finish reason are those that the
same tokens would have made coming one per step."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_detokenizer import PIECES, piece_tokenizer

from triode.actors.generate_call import GenerateCall
from triode.wire import EngineCoreOutput, FinishReason, Logprobs, SamplingParams

Result = tuple[str, list[int], list[tuple[int, float]], str | None, int | str | None]


def ids_of(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def logprob_of(position: int) -> float:
    return -(position + 1) / 8  # exact in float32, and one of its own per position


def logprobs(first: int, ids: list[int]) -> Logprobs:
    """Rows for the tokens at positions `first`.. of the output."""
    positions = range(first, first + len(ids))
    return Logprobs(
        np.array([[t, 0] for t in ids], dtype=np.int32),
        np.array([[logprob_of(p), -9.0] for p in positions], dtype=np.float32),
        np.ones(len(ids), dtype=np.int32),
    )


def outputs(ids: list[int], chunks: list[int], finish: dict[str, Any]) -> list[EngineCoreOutput]:
    """`ids` in outputs of `chunks` tokens each, the last carrying `finish`."""
    assert sum(chunks) == len(ids)
    out, at = [], 0
    for size in chunks:
        part = ids[at : at + size]
        out.append(EngineCoreOutput("r", part, new_logprobs=logprobs(at, part)))
        at += size
    out[-1] = EngineCoreOutput(
        "r", out[-1].new_token_ids, new_logprobs=out[-1].new_logprobs, **finish
    )
    return out


def generate(params: SamplingParams, sent: list[EngineCoreOutput]) -> Result:
    """What a call made of `sent`, checked to be what its deltas add up to."""
    engine = SimpleNamespace(tokenizer=piece_tokenizer(), extra_eos_token_ids=[])
    call = GenerateCall(engine, "r", None, ids_of("x"), params)  # type: ignore[arg-type]
    text, token_ids, rows = "", [], []
    for out in sent:
        call.take(out)
        (delta,) = call.snapshot(delta=True).outputs
        text += delta.text
        token_ids += delta.token_ids
        rows += delta.logprobs or []
    (whole,) = call.snapshot(delta=False).outputs
    assert call.finished
    assert (text, token_ids, rows) == (whole.text, whole.token_ids, whole.logprobs)
    lps = [(lp.token_id, lp.logprob) for lp in rows]
    return text, token_ids, lps, whole.finish_reason, whole.stop_reason


def splits(n: int, rng: random.Random) -> list[list[int]]:
    """Ways to cut `n` tokens into outputs of 2-5 (the last may be shorter), some at random."""
    found = [[n]]
    for size in range(2, 6):
        found.append([size] * (n // size) + ([n % size] if n % size else []))
    for _ in range(20):
        chunks, left = [], n
        while left:
            chunks.append(min(left, rng.randint(1, 5)))
            left -= chunks[-1]
        found.append(chunks)
    return found


def assert_same_however_split(
    params: SamplingParams, ids: list[int], finish: dict[str, Any], chunkings: list[list[int]]
) -> Result:
    one_by_one = generate(params, outputs(ids, [1] * len(ids), finish))
    for chunks in chunkings:
        assert generate(params, outputs(ids, chunks, finish)) == one_by_one, chunks
    return one_by_one


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_keeps_the_tokens_up_to_the_one_it_completed_in(include: bool) -> None:
    ids = ids_of("x", "a", "b", "c", "a", "b", "x", "x")  # "cab" completes in token 5
    params = SamplingParams(stop=["cab"], include_stop_str_in_output=include, logprobs=1)
    # [2, 5, 1]: in the middle of an output; [3, 3, 2]: at its end; [5, 3]: at its start
    chunkings = [[2, 5, 1], [3, 3, 2], [5, 3], *splits(len(ids), random.Random(1))]

    result = assert_same_however_split(
        params, ids, {"finish_reason": FinishReason.LENGTH}, chunkings
    )

    kept = ids[:6]
    lps = [(t, logprob_of(p)) for p, t in enumerate(kept)]
    assert result == ("xabcab" if include else "xab", kept, lps, "stop", "cab")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_last_of_several_ends_the_output_with_it(include: bool) -> None:
    eos = PIECES.index(".")
    ids = ids_of("a", "b", "c", ".")
    params = SamplingParams(stop_token_ids=[eos], include_stop_str_in_output=include, logprobs=1)
    finish = {"finish_reason": FinishReason.STOP, "stop_reason": eos}

    result = assert_same_however_split(params, ids, finish, splits(len(ids), random.Random(2)))

    lps = [(t, logprob_of(p)) for p, t in enumerate(ids)]
    assert result == ("abc." if include else "abc", ids, lps, "stop", eos)


def test_a_stop_string_before_a_stop_token_in_the_same_output_wins() -> None:
    eos = PIECES.index(".")
    ids = ids_of("a", "b", "c", "a", "b", ".")
    params = SamplingParams(stop=["cab"], stop_token_ids=[eos], logprobs=1)
    finish = {"finish_reason": FinishReason.STOP, "stop_reason": eos}

    result = assert_same_however_split(params, ids, finish, splits(len(ids), random.Random(3)))

    lps = [(t, logprob_of(p)) for p, t in enumerate(ids[:5])]
    assert result == ("ab", ids[:5], lps, "stop", "cab")


def test_min_tokens_counts_each_token_of_an_output() -> None:
    # "cab" in tokens 0-2 is within min_tokens=3; the one in tokens 4-6 ends the output
    ids = ids_of("c", "a", "b", "x", "c", "a", "b", "x")
    params = SamplingParams(stop=["cab"], min_tokens=3, logprobs=1)
    chunkings = [[4, 4], [5, 3], *splits(len(ids), random.Random(4))]

    result = assert_same_however_split(
        params, ids, {"finish_reason": FinishReason.LENGTH}, chunkings
    )

    lps = [(t, logprob_of(p)) for p, t in enumerate(ids[:7])]
    assert result == ("cabx", ids[:7], lps, "stop", "cab")


def test_without_a_stop_every_token_is_kept() -> None:
    rng = random.Random(5)
    ids = [rng.randrange(1, len(PIECES)) for _ in range(30)]
    params = SamplingParams(stop=["never"], logprobs=1)

    result = assert_same_however_split(
        params, ids, {"finish_reason": FinishReason.LENGTH}, splits(len(ids), rng)
    )

    lps = [(t, logprob_of(p)) for p, t in enumerate(ids)]
    assert result == ("".join(PIECES[t] for t in ids), ids, lps, "length", None)


def test_a_delta_tells_each_choice_s_end_once() -> None:
    """With n = 2, a choice that ended is not said to end again in the deltas that carry the
    other's tokens (a stream would repeat its finish_reason in every later chunk)."""
    engine = SimpleNamespace(tokenizer=piece_tokenizer(), extra_eos_token_ids=[])
    params = SamplingParams(n=2, max_tokens=4)
    call = GenerateCall(engine, "r", None, ids_of("x"), params)  # type: ignore[arg-type]
    first, second = call.child_ids
    ended = {"finish_reason": FinishReason.LENGTH}
    told: list[list[str | None]] = []
    for out in (
        EngineCoreOutput(first, ids_of("a", "b")),
        EngineCoreOutput(second, ids_of("a")),
        EngineCoreOutput(first, ids_of("c", "a"), **ended),
        EngineCoreOutput(second, ids_of("b")),
        EngineCoreOutput(second, ids_of("c", "a"), **ended),
    ):
        call.take(out)
        told.append([c.finish_reason for c in call.snapshot(delta=True).outputs])
    assert told == [[None, None], [None, None], ["length", None], [None, None], [None, "length"]]
    assert [c.finish_reason for c in call.snapshot(delta=False).outputs] == ["length", "length"]
