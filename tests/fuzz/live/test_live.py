"""The live fuzzer: its parts in isolation, then bounded runs over HTTP and ZMQ against
tiny-random that must find no violation."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from triode.fuzz.live import http_fuzzer as live_http
from triode.fuzz.live import zmq_fuzzer as live_zmq
from triode.fuzz.live.cli import LAUNCH_ENV, parse_args
from triode.fuzz.live.http_fuzzer import check_outcome, needs_key, under_v1
from triode.fuzz.live.http_mutator import HttpMutator
from triode.fuzz.live.http_plan import INVALID, UNSURE, VALID, Plan, Req
from triode.fuzz.live.raw_http import Outcome, Responses
from triode.wire import InputDecoder, ProtocolError

SECONDS = 12  # in the suite; `triode fuzz live` runs for as long as it is given
SEED = 7


@pytest.mark.parametrize(
    "target",
    [b"/v1/models", b"//v1/models", b"/x/../v1/models", b"/v1%2Fchat%2Fcompletions",
     b"/%76%31/models", b"/%2576%2531/models", b"/V1/models", b"/v1", b"\\v1\\models",
     b"http://host/v1/models?x=1", b"/v1/models#frag", b"/health/../v1/models"],
)  # fmt: skip
def test_every_spelling_of_a_v1_path_counts_as_under_v1(target: bytes) -> None:
    assert under_v1(target)


@pytest.mark.parametrize("target", [b"/health", b"/tokenize", b"/v10/models", b"/", b"*", b""])
def test_paths_outside_v1_do_not(target: bytes) -> None:
    assert not under_v1(target)


@pytest.mark.parametrize(
    "target", [b"/tokenize", b"/detokenize?x=1", b"/%74okenize", b"//TOKENIZE", b"/v1/../tokenize"]
)
def test_tokenize_and_detokenize_by_any_spelling_need_a_key(target: bytes) -> None:
    assert needs_key(target)
    assert check_outcome(_plan(b"POST", target, INVALID), Outcome([200], [b""]), True)


@pytest.mark.parametrize("target", [b"/health", b"/version", b"/metrics"])
def test_operational_paths_need_no_key(target: bytes) -> None:
    assert not needs_key(target)


def test_responses_parse_lengths_chunks_head_and_interim_answers() -> None:
    responses = Responses([b"POST", b"HEAD", b"GET"])
    data = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n"
        b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\nno"
    )
    for i in range(len(data)):  # byte by byte: no answer depends on how reads split
        responses.feed(data[i : i + 1])
    assert responses.done
    assert responses.statuses == [200, 200, 404]
    assert responses.bodies == [b"hello", b"", b"no"]


def _plan(method: bytes, target: bytes, auth: str) -> Plan:
    return Plan("test", [Req(method, target, auth)], b"")


def test_a_5xx_a_keyless_2xx_under_v1_and_a_refused_valid_key_are_violations() -> None:
    assert check_outcome(_plan(b"GET", b"/v1/models", VALID), Outcome([500], [b""]), True)
    assert check_outcome(_plan(b"GET", b"//v1/models", INVALID), Outcome([200], [b""]), True)
    assert check_outcome(_plan(b"GET", b"/v1/models", VALID), Outcome([401], [b""]), True)


def test_refusals_previews_and_unsure_keys_are_not() -> None:
    assert not check_outcome(_plan(b"GET", b"/v1/models", INVALID), Outcome([401], [b""]), True)
    assert not check_outcome(_plan(b"OPTIONS", b"/v1/models", INVALID), Outcome([204], [b""]), True)
    assert not check_outcome(_plan(b"GET", b"/v1/models", UNSURE), Outcome([200], [b""]), True)
    assert not check_outcome(_plan(b"GET", b"/health", INVALID), Outcome([200], [b""]), True)


def test_a_complete_request_closed_without_an_answer_is_a_violation() -> None:
    plan = _plan(b"GET", b"/v1/models", VALID)
    assert check_outcome(plan, Outcome([], [], "eof"), True)
    plan.expect_answer = False
    assert not check_outcome(plan, Outcome([], [], "eof"), True)


def test_a_saved_plan_replays_the_way_it_was_sent() -> None:
    rng = random.Random(SEED)
    mutator = HttpMutator(rng, b"127.0.0.1:1", "key", "model")
    plans = [mutator.plan() for _ in range(300)]
    for plan in plans:
        again = Plan.replaying(plan.raw(), f"00001-{plan.kind}{plan.how()}.http")
        assert again.data == plan.raw()
        assert (again.truncate is None) == (plan.truncate is None)
        assert (again.pieces, again.read_limit) == (plan.pieces, plan.read_limit)
    assert len({p.kind for p in plans}) == len(HttpMutator.KINDS)


def test_the_zmq_mutator_is_deterministic_and_mixes_valid_and_broken_messages() -> None:
    def draw(seed: int) -> list[list[bytes]]:
        mutator = live_zmq.ZmqMutator(random.Random(seed), vocab_size=1000, max_model_len=64)
        return [mutator.message()[1] for _ in range(300)]

    first = draw(SEED)
    assert first == draw(SEED)
    decoder = InputDecoder()
    decodable = 0
    for frames in first:
        try:
            decoder.decode(frames)
            decodable += 1
        except ProtocolError:
            pass
    assert 0.2 < decodable / len(first) < 0.8


@pytest.mark.slow
async def test_fuzzing_a_launched_server_over_http_finds_no_violation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in LAUNCH_ENV.items():
        monkeypatch.setenv(name, value)
    args = parse_args(["http", "--launch", "tiny-random", "--seconds", str(SECONDS),
                       "--seed", str(SEED), "--concurrency", "16",
                       "--crash-dir", str(tmp_path)])  # fmt: skip
    report = await live_http.fuzz(args)
    assert report.violations == [], report.format()
    assert report.rounds >= 3, report.format()
    assert report.total >= 100, report.format()
    assert {"200", "400", "401", "404"} <= set(report.outcomes), report.format()


@pytest.mark.slow
async def test_fuzzing_an_engine_core_over_zmq_finds_no_violation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in LAUNCH_ENV.items():
        monkeypatch.setenv(name, value)
    report = await live_zmq.fuzz_engine(
        "tiny-random", SECONDS, SEED, tmp_path, kv_cache_memory=live_zmq.SMALL_KV_CACHE
    )
    assert report.violations == [], report.format()
    assert report.rounds >= 3, report.format()
    assert report.total >= 500, report.format()
    assert report.protocol_errors > 0, report.format()
    assert report.outcomes["add_request"] > 0, report.format()
