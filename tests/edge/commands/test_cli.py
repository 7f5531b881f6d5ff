"""The `triode serve` command line: flags in vLLM's spelling, keys from flags and environment."""

from __future__ import annotations

import re

import pytest

from triode.edge.auth import keys_from
from triode.edge.cli import build_parser
from triode.edge.commands.engine_flags import given_engine_args


def _serve(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "argv",
    [["--api-key", "a", "--api-key", "b"], ["--api-key", "a", "b"]],
)
def test_two_spellings_give_two_keys(argv: list[str]) -> None:
    args = _serve(*argv)
    assert args.api_key == ["a", "b"]
    assert keys_from(args.api_key, {"TRIODE_API_KEY": "c, a,"}) == ["a", "b", "c"]


def test_model_is_positional_and_optional() -> None:
    assert _serve().model is None
    assert _serve("tiny-random", "--port", "0").model == "tiny-random"


def test_engine_flags_reach_the_engine_only_when_given() -> None:
    args = _serve("--max-model-len", "2048", "--kv-cache-memory", "1GiB", "--dtype", "float32",
                  "--no-enable-prefix-caching", "--quantization", "none")  # fmt: skip
    assert given_engine_args(args) == {
        "quantization": "none",
        "max_model_len": 2048,
        "kv_cache_memory": "1GiB",
        "dtype": "float32",
        "enable_prefix_caching": False,
    }
    assert given_engine_args(_serve()) == {}


def test_every_engine_arg_is_a_serve_flag_but_the_model_and_the_block_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import msgspec

    from triode.actors import EngineArgs

    with pytest.raises(SystemExit):
        _serve("--help")
    listed = set(re.findall(r"--[a-z-]+", capsys.readouterr().out))
    fields = {f"--{f.name.replace('_', '-')}" for f in msgspec.structs.fields(EngineArgs)}
    assert fields - listed == {"--model", "--block-size"}


def test_a_bad_dtype_is_refused() -> None:
    with pytest.raises(SystemExit):
        _serve("--dtype", "int4")


def test_quantization_is_auto_or_none_on_the_command_line_and_in_engine_args() -> None:
    from triode.actors.config import EngineArgs

    with pytest.raises(SystemExit):
        _serve("--quantization", "gptq")
    assert EngineArgs().quantization == "auto"
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="gptq")


def test_gguf_arithmetic_is_exact_or_integer() -> None:
    from triode.actors.config import EngineArgs

    assert given_engine_args(_serve("--gguf-arithmetic", "integer")) == {
        "gguf_arithmetic": "integer"
    }
    with pytest.raises(SystemExit):
        _serve("--gguf-arithmetic", "int4")
    assert EngineArgs().gguf_arithmetic == "exact"
    with pytest.raises(ValueError, match="gguf_arithmetic"):
        EngineArgs(gguf_arithmetic="fast")


def test_max_new_prompt_tokens_is_a_flag_and_refused_below_0() -> None:
    from triode.actors.config import EngineArgs

    assert _serve("--max-new-prompt-tokens", "0").max_new_prompt_tokens == 0
    assert EngineArgs().max_new_prompt_tokens == 256
    with pytest.raises(ValueError, match="max_new_prompt_tokens"):
        EngineArgs(max_new_prompt_tokens=-1)


def test_parallel_flags_reach_the_engine_args() -> None:
    from triode.actors.config import EngineArgs

    args = _serve("-tp", "2", "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank",
                  "1", "--master-addr", "10.0.0.1", "--master-port", "29500",
                  "--distributed-timeout", "5", "--headless",
                  "--cluster-key-file", "/etc/triode/cluster.key")  # fmt: skip
    engine = EngineArgs(**given_engine_args(args))
    assert (engine.world_size, engine.executor_backend, engine.node_rank) == (4, "mp", 1)
    assert (engine.master_addr, engine.master_port, engine.distributed_timeout) == (
        "10.0.0.1", 29500, 5.0
    )  # fmt: skip
    assert args.headless and engine.cluster_key_file == "/etc/triode/cluster.key"
    assert EngineArgs().executor_backend == "inproc"


@pytest.mark.parametrize(
    ("engine_args", "complaint"),
    [
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "inproc"}, "world of one"),
        ({"tensor_parallel_size": 3, "nnodes": 2, "master_port": 1234}, "evenly"),
        ({"nnodes": 2, "tensor_parallel_size": 2}, "master-port"),
        ({"nnodes": 2, "tensor_parallel_size": 2, "master_port": 1234}, "cluster-key-file"),
        ({"node_rank": 1}, "node_rank"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
        ({"distributed_executor_backend": "ray"}, "mp or inproc"),
    ],
)
def test_inconsistent_parallel_args_are_refused(engine_args: dict, complaint: str) -> None:
    from triode.actors.config import EngineArgs

    with pytest.raises(ValueError, match=complaint):
        EngineArgs(**engine_args)


def test_a_headless_node_0_and_a_bare_node_rank_are_refused() -> None:
    from triode.edge.cli import main

    with pytest.raises(SystemExit, match="node-rank"):
        main(["serve", "--nnodes", "2", "--node-rank", "1", "--master-port", "29500"])
    with pytest.raises(SystemExit, match="node 0"):
        main(["serve", "--headless", "-tp", "2", "--nnodes", "2", "--master-port", "29500",
              "--cluster-key-file", "unused"])  # fmt: skip


def test_prefix_cache_isolation_by_key_is_refused_without_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from triode.edge.cli import main

    assert _serve().prefix_cache_isolation == "none"
    assert _serve("--prefix-cache-isolation", "key").prefix_cache_isolation == "key"
    with pytest.raises(SystemExit):
        _serve("--prefix-cache-isolation", "user")
    monkeypatch.delenv("TRIODE_API_KEY", raising=False)
    # refused before any model loads: without keys every caller would be one tenant
    with pytest.raises(SystemExit, match="--prefix-cache-isolation key needs API keys"):
        main(["serve", "--prefix-cache-isolation", "key"])


def test_max_waiting_requests_is_a_flag_bounded_by_default_and_0_is_no_bound() -> None:
    from triode.actors.config import EngineArgs

    assert _serve("--max-waiting-requests", "0").max_waiting_requests == 0
    assert EngineArgs().max_waiting_requests == 4096
    with pytest.raises(ValueError, match="max_waiting_requests"):
        EngineArgs(max_waiting_requests=-1)


def test_trust_boundary_flags_reach_the_app_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import trio

    from triode.edge import cli

    captured = {}

    def fake_run(serve, options, settings, engine_args):  # type: ignore[no-untyped-def]
        captured["settings"] = settings(None)

    monkeypatch.setattr(trio, "run", fake_run)
    cli.main(["serve", "--api-key", "k", "--metrics-require-key", "--allow-request-tool-servers",
              "--allow-private-tool-servers", "--max-background-responses", "3",
              "--response-ttl", "60", "--max-stored-responses", "10"])  # fmt: skip
    settings = captured["settings"]
    assert settings.metrics_require_key and settings.allow_private_tool_servers
    assert (settings.max_background_responses, settings.response_ttl) == (3, 60.0)
    assert settings.max_stored_responses == 10
    defaults = _serve()
    assert not defaults.metrics_require_key and not defaults.allow_private_tool_servers
    assert (defaults.max_background_responses, defaults.response_ttl) == (32, 3600.0)
    for bad in (["--response-ttl", "0"], ["--max-background-responses", "0"]):
        with pytest.raises(SystemExit):
            cli.main(["serve", *bad])


def test_replay_takes_recorded_remote_arguments_only_when_told() -> None:
    args = build_parser().parse_args(["replay", "dir"])
    assert not args.trust_recorded_args
    assert build_parser().parse_args(["replay", "dir", "--trust-recorded-args"]).trust_recorded_args
