"""Record an engine core's wire traffic, replay it against a new engine, compare: on tiny-random,
float32 and greedy sampling, the replay agrees; a tampered token shows up as exactly that
request differing at that index (through `triode replay`, with its exit status)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import aclosing
from pathlib import Path

import pytest
import trio
from processes import actor_processes, alive

from triode.actors import Engine, SamplingParams, open_engine
from triode.actors.config import EngineArgs
from triode.actors.forkserver import Forkserver
from triode.actors.wire_replay import UntrustedRecordingError, _replay_args, replay
from triode.wire import Encoder, OutputDecoder, Recorder, encode_output, read_records

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 512}
PROMPT = [5, 17, 42, 9, 100, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TAMPERED = ("plain-0", 3)  # the request and token index the tampered recording changes


async def _tokens(engine: Engine, request_id: str, params: SamplingParams) -> list[int]:
    outputs = [out async for out in engine.generate(PROMPT, params, request_id)]
    return outputs[-1].outputs[0].token_ids


async def _record(directory: Path) -> None:
    """Greedy requests side by side: two plain, one aborted after its third token, one ended
    by a stop string (the text of a token its own prompt's answer has, found first)."""
    async with open_engine("tiny-random", record_wire=str(directory), **ENGINE_ARGS) as engine:
        tokens = await _tokens(engine, "probe", GREEDY)
        texts = [engine.tokenizer.decode([t]) for t in tokens[4:]]
        stop = next(t for t in texts if t.strip() and "\ufffd" not in t)
        ends: dict[str, str | None] = {}

        async def plain(request_id: str, prompt: list[int]) -> None:
            async for out in engine.generate(prompt, GREEDY, request_id):
                ends[request_id] = out.outputs[0].finish_reason

        async def aborted() -> None:
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            async with aclosing(engine.generate(PROMPT[::-1], long, "aborted", delta=True)) as outs:
                seen = 0
                async for out in outs:
                    seen += len(out.outputs[0].token_ids)
                    if seen >= 3:
                        break

        async def stopped() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
            async for out in engine.generate(PROMPT, params, "stopped"):
                ends["stopped"] = out.outputs[0].finish_reason

        async with trio.open_nursery() as nursery:
            nursery.start_soon(plain, "plain-0", PROMPT[:4])
            nursery.start_soon(plain, "plain-1", PROMPT[2:])
            nursery.start_soon(aborted)
            nursery.start_soon(stopped)
        pid = engine.pid
    assert ends == {"plain-0": "length", "plain-1": "length", "stopped": "stop"}
    assert not alive(pid)


def _tamper(source: Path, target: Path) -> tuple[int, int]:
    """Copy the recording with one output token of `TAMPERED` changed; (recorded, new)."""
    request_id, index = TAMPERED
    target.mkdir()
    (target / "meta.json").write_bytes((source / "meta.json").read_bytes())
    recorder = Recorder(target)
    decoder, encoder = OutputDecoder(), Encoder()
    seen = 0
    changed: tuple[int, int] | None = None
    for record in read_records(source):
        if record.direction == "out" and changed is None:
            client, outputs = decoder.decode(record.frames)
            for output in outputs.outputs:
                if output.request_id != request_id:
                    continue
                at = index - seen
                seen += len(output.new_token_ids)
                if 0 <= at < len(output.new_token_ids):
                    old = output.new_token_ids[at]
                    output.new_token_ids[at] = old + 1
                    changed = old, old + 1
                    record.frames = [bytes(f) for f in encode_output(encoder, client, outputs)]
        recorder.write(record)
    recorder.close()
    assert changed is not None
    return changed


def _run(command: list[str]) -> tuple[int, int, bytes, bytes]:
    """`command`'s pid, exit status, stdout and stderr."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = process.communicate(timeout=60)
    return process.pid, process.returncode, stdout, stderr


async def test_a_replay_agrees_with_its_recording_and_finds_a_tampered_token(
    tmp_path: Path, forkserver: Forkserver
) -> None:
    recording = tmp_path / "recording"
    with trio.fail_after(60):
        await _record(recording)
        report = await replay(recording)
    assert report.ok and report.differences == []
    assert report.identical == 5 and report.skipped == 0 and report.protocol_errors == 0
    # no engine core outlives a replay (forked ones stay the fork server's children)
    assert "engine-core" not in actor_processes(os.getpid(), forkserver.pid)

    recorded, tampered_to = _tamper(recording, tmp_path / "tampered")
    cli = [sys.executable, "-m", "triode.edge.cli", "replay", str(tmp_path / "tampered"), "--json"]
    pid, returncode, stdout, stderr = await trio.to_thread.run_sync(_run, cli)
    assert returncode == 1, stderr.decode()[-2000:]
    report_json = json.loads(stdout)
    request_id, index = TAMPERED
    assert report_json["identical"] == 4
    assert report_json["differences"] == [
        {"request_id": request_id, "index": index, "recorded": tampered_to, "replayed": recorded}
    ]
    assert "engine-core" not in actor_processes(pid, forkserver.pid)


# What a recording may ask for

RECORDED_REMOTE = {
    "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.9", "master_port": 29500,
    "kv_transfer_config": {"kv_connector": "TriodeConnector", "kv_role": "kv_consumer"},
    "cluster_key_file": "/tmp/someone-elses.key",
}  # fmt: skip
RECORDED_REMOTE = {k: v for k, v in RECORDED_REMOTE.items() if k in EngineArgs.__struct_fields__}


@pytest.mark.parametrize(("name", "value"), list(RECORDED_REMOTE.items()))
def test_recorded_multi_node_and_kv_arguments_are_refused_unless_given(
    name: str, value: object
) -> None:
    # Who hands over a recording: anyone; what it could make a replay do: join a rendezvous or
    # open KV connections to hosts it names. So those arguments need the operator's word.
    meta = {"engine_args": {**ENGINE_ARGS, "model": "tiny-random", name: value}}

    with pytest.raises(UntrustedRecordingError, match=name):
        _replay_args(meta, None, {})
    default = getattr(EngineArgs(), name)
    assert getattr(_replay_args(meta, None, {name: default}), name) == default


def test_trusted_multi_node_arguments_are_taken() -> None:
    remote = {"nnodes": 2, "node_rank": 0, "master_addr": "10.0.0.9", "master_port": 29500}
    if "cluster_key_file" in EngineArgs.__struct_fields__:  # several nodes need one
        remote["cluster_key_file"] = "/etc/triode/cluster.key"
    meta = {"engine_args": {**ENGINE_ARGS, "tensor_parallel_size": 2, **remote}}

    args = _replay_args(meta, None, {}, trust_recorded_args=True)

    assert {name: getattr(args, name) for name in remote} == remote


def test_defaults_in_a_recording_are_taken_and_it_never_records(tmp_path: Path) -> None:
    defaults = EngineArgs()
    recorded = {name: getattr(defaults, name) for name in RECORDED_REMOTE}
    meta = {"engine_args": {**ENGINE_ARGS, **recorded, "record_wire": str(tmp_path)}}

    args = _replay_args(meta, None, {})

    assert args.record_wire is None and args.nnodes == 1 and args.kv_transfer_config is None


def test_triode_replay_refuses_a_recording_that_asks_for_another_node(tmp_path: Path) -> None:
    recording = tmp_path / "recording"
    recording.mkdir()
    meta = {"engine_args": {**ENGINE_ARGS, "model": "tiny-random", **RECORDED_REMOTE}}
    (recording / "meta.json").write_text(json.dumps(meta))
    cli = [sys.executable, "-m", "triode.edge.cli", "replay", str(recording)]

    _, returncode, _, stderr = _run(cli)

    assert returncode != 0
    message = stderr.decode()
    assert "--trust-recorded-args" in message and "master_addr='10.0.0.9'" in message
