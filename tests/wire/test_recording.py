"""Wire recordings: records round-trip, files rotate within their bound, and the reader is
total: a torn last record is skipped, anything else that is not a recording raises."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import msgspec
import pytest

from triode.fuzz.harnesses import wire as wire_harness
from triode.fuzz.make_corpus import recorded_wire_seeds
from triode.wire import (
    Encoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    InputDecoder,
    ProtocolError,
    Record,
    Recorder,
    SamplingParams,
    encode_input,
    encode_output,
    open_recorder,
    read_meta,
    read_records,
)
from triode.wire.recording import MAGIC, record_files

ENCODER = Encoder()
META = {"engine_args": {"model": "tiny-random", "dtype": "float32"}, "num_clients": 1}


def _input(i: int) -> list[bytes]:
    request = EngineCoreRequest(f"r{i}", [5, 17, i], SamplingParams(temperature=0.0), 2)
    return [bytes(f) for f in encode_input(ENCODER, EngineCoreRequestType.ADD_REQUEST, request)]


def _output(i: int) -> list[bytes]:
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}", [i, i + 1])], seq=i)
    return [bytes(f) for f in encode_output(ENCODER, 0, outputs)]


def _framed(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def _write(directory: Path, count: int, **limits: int) -> list[tuple[str, list[bytes]]]:
    recorder = Recorder(directory, **limits)
    written = []
    for i in range(count):
        for direction, frames in (("in", _input(i)), ("out", _output(i))):
            recorder.record(direction, frames)  # type: ignore[arg-type]
            written.append((direction, frames))
    recorder.close()
    return written


async def test_records_round_trip_with_meta_and_order(tmp_path: Path) -> None:
    async with open_recorder(tmp_path / "rec", META) as recorder:
        recorder.record("in", [memoryview(f) for f in _input(0)])
        recorder.record("out", _output(0))
        recorder.write(Record(12.5, "in", [b"\x01", b"\x91\xa2r0"]))
    meta = read_meta(tmp_path / "rec")
    records = list(read_records(tmp_path / "rec"))

    assert meta["engine_args"] == META["engine_args"] and meta["start_time"] > 1.6e9
    assert [(r.direction, r.frames) for r in records] == [
        ("in", _input(0)),
        ("out", _output(0)),
        ("in", [b"\x01", b"\x91\xa2r0"]),
    ]
    assert records[0].timestamp <= records[1].timestamp and records[2].timestamp == 12.5
    kind, request = InputDecoder().decode(records[0].frames)
    assert kind is EngineCoreRequestType.ADD_REQUEST and request.request_id == "r0"  # type: ignore[union-attr]


def test_a_recorded_request_keeps_its_cache_salt(tmp_path: Path) -> None:
    # a replay sends the recorded frames as they are: the salt, and so the prefix-cache
    # sharing, of each request is what it was
    request = EngineCoreRequest("s", [5, 17], SamplingParams(), cache_salt="key abc salt s1")
    frames = [bytes(f) for f in encode_input(ENCODER, EngineCoreRequestType.ADD_REQUEST, request)]
    recorder = Recorder(tmp_path)
    recorder.record("in", frames)
    recorder.close()

    [record] = read_records(tmp_path)
    _, decoded = InputDecoder().decode(record.frames)

    assert decoded == request


async def test_a_directory_with_a_recording_is_refused(tmp_path: Path) -> None:
    async with open_recorder(tmp_path, META):
        pass
    with pytest.raises(FileExistsError):
        async with open_recorder(tmp_path, META):
            pass


def test_files_rotate_and_only_the_newest_are_kept_within_the_bound(tmp_path: Path) -> None:
    written = _write(tmp_path, 200, max_file_bytes=2048, max_files=3)

    files = record_files(tmp_path)
    numbers = [int(p.stem.removeprefix("wire-")) for p in files]
    assert len(files) == 3 and numbers == list(range(numbers[0], numbers[0] + 3))
    assert numbers[0] > 1  # rotated, the oldest deleted
    assert all(p.stat().st_size <= 2048 for p in files)
    kept = [(r.direction, r.frames) for r in read_records(tmp_path)]
    assert kept == written[-len(kept) :]  # the newest, in order, none lost inside
    pair = sum(4 + len(msgspec.msgpack.encode(Record(0.0, d, fr))) for d, fr in written[-2:])  # type: ignore[arg-type]
    whole_file = (2048 - len(MAGIC)) // pair * 2  # records in one full file
    assert len(kept) > 2 * whole_file - 2  # two whole files' worth at least


def test_a_record_larger_than_a_file_gets_a_file_of_its_own(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, max_file_bytes=512, max_files=8)
    recorder.record("in", _input(0))
    recorder.record("in", [b"\x00", bytes(2000)])
    recorder.record("in", _input(1))
    recorder.close()

    assert len(record_files(tmp_path)) == 3
    sizes = [len(r.frames[-1]) for r in read_records(tmp_path)]
    assert sizes == [len(_input(0)[1]), 2000, len(_input(1)[1])]


@pytest.mark.parametrize("cut", [1, 3, 4, 10])
def test_a_torn_last_record_is_skipped(tmp_path: Path, cut: int) -> None:
    written = _write(tmp_path, 5)
    [path] = record_files(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-cut])

    assert [(r.direction, r.frames) for r in read_records(tmp_path)] == written[:-1]


def test_a_last_file_killed_before_its_first_flush_reads_as_empty(tmp_path: Path) -> None:
    written = _write(tmp_path, 3, max_file_bytes=64)  # one record a file
    files = record_files(tmp_path)
    files[-1].write_bytes(MAGIC[:5])

    assert len(files) == len(written)
    assert [(r.direction, r.frames) for r in read_records(tmp_path)] == written[:-1]


def test_a_torn_record_in_an_older_file_raises(tmp_path: Path) -> None:
    _write(tmp_path, 20, max_file_bytes=512)
    first = record_files(tmp_path)[0]
    first.write_bytes(first.read_bytes()[:-3])

    with pytest.raises(ProtocolError, match="ends inside a record"):
        list(read_records(tmp_path))


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda data: b"not a recording at all" + data,
        lambda data: data[: len(MAGIC)] + b"\x00\x00\x00\x03\xff\xff\xff" + data[len(MAGIC) :],
        lambda data: data[: len(MAGIC)] + _framed(msgspec.msgpack.encode(["x", "in", []])),
    ],
    ids=["magic", "undecodable-record", "wrong-types"],
)
def test_a_corrupt_file_raises_protocol_error(tmp_path: Path, corrupt: object) -> None:
    _write(tmp_path, 3)
    [path] = record_files(tmp_path)
    path.write_bytes(corrupt(path.read_bytes()))  # type: ignore[operator]

    with pytest.raises(ProtocolError):
        list(read_records(tmp_path))


def test_a_huge_length_at_the_end_is_a_torn_record_not_an_allocation(tmp_path: Path) -> None:
    written = _write(tmp_path, 2)
    [path] = record_files(tmp_path)
    path.write_bytes(path.read_bytes() + b"\xff\xff\xff\xff" + b"\x93")

    assert [(r.direction, r.frames) for r in read_records(tmp_path)] == written


def test_bad_meta_raises_protocol_error(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ProtocolError):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_bytes(b"\xff{")
    with pytest.raises(ProtocolError):
        read_meta(tmp_path)


def test_a_failed_write_ends_the_recording_without_raising(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path / "gone")  # no such directory: the first file cannot open
    recorder.record("in", _input(0))
    recorder.record("in", _input(1))

    assert isinstance(recorder.failed, FileNotFoundError) and recorder.records == 0


def test_recorded_inputs_become_wire_harness_seeds_that_pass(tmp_path: Path) -> None:
    written = _write(tmp_path, 4)
    seeds = list(recorded_wire_seeds(tmp_path))

    assert len(seeds) == sum(d == "in" for d, _ in written)
    for seed in seeds:
        wire_harness.test_one_input(seed)


# The recording is the operator's alone


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


async def test_a_new_recording_directory_is_0700_and_its_files_0600(tmp_path: Path) -> None:
    # Who can read a recording: its user only; it holds every prompt and answer the engine saw.
    # Its size stays within max_files * max_file_bytes (8 x 64 MiB by default).
    target = tmp_path / "parent" / "rec"
    async with open_recorder(target, META) as recorder:
        recorder.record("in", _input(0))

    assert _mode(target) == 0o700 and _mode(target.parent) == 0o700
    files = sorted(p.name for p in target.iterdir())
    assert files == ["meta.json", "wire-000001.rec"]
    assert all(_mode(target / name) == 0o600 for name in files)


async def test_a_symlinked_recording_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "rec").symlink_to(elsewhere)

    with pytest.raises(PermissionError, match="symbolic link"):
        async with open_recorder(tmp_path / "rec", META):
            pass
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
async def test_a_directory_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)

    with pytest.raises(PermissionError, match="group or others"):
        async with open_recorder(shared, META):
            pass
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root")
async def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)

    with pytest.raises(PermissionError, match="another user"):
        async with open_recorder(theirs, META):
            pass


def test_a_symlink_planted_as_the_next_file_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    recording = tmp_path / "rec"
    recording.mkdir(mode=0o700)
    recorder = Recorder(recording)
    (recording / "wire-000001.rec").symlink_to(victim)

    recorder.record("in", _input(0))

    assert isinstance(recorder.failed, FileExistsError)
    assert victim.read_bytes() == b"precious"
