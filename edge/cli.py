"""The `triode` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from functools import partial
from importlib.metadata import version

BENCHMARKS = {
    "wire": "triode.wire.bench",
    "throughput": "triode.edge.bench.throughput",
    "serve": "triode.edge.bench.serve",
    "ab": "triode.edge.bench.ab",
    "frontend": "triode.edge.bench.frontend",
    "vllm": "triode.edge.bench.vllm",
    "structured": "triode.edge.bench.structured",
    "collectives": "triode.gpu.bench.collectives",
    "step": "triode.gpu.bench.step",
    "kv-transfer": "triode.gpu.bench.kv_transfer",
}


def _serve_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API",
        description="Serve the OpenAI API (chat, completions, models) over HTTP.",
    )
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hugging Face directory, a .gguf file, or tiny-random (default: the default model)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=None,
        help="accept this key (repeatable; also TRIODE_API_KEY, comma-separated)",
    )
    serve.add_argument(
        "--prefix-cache-isolation",
        choices=["none", "key"],
        default="none",
        help="key: requests share cached prompt blocks only with requests under the same API "
        "key, so no key holder can tell another's prompts by cached_tokens (needs --api-key); "
        "a request's cache_salt always separates it",
    )
    serve.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="put /metrics behind the key too (it is open for scrapers by default)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model names the API answers to (default: the model's)",
    )
    serve.add_argument("--root-path", default="", help="the path prefix behind a proxy")
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes sharing the port (each a client of every engine core)",
    )
    serve.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        help="CORS origins to allow ('*' for any); none by default",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    serve.add_argument("--max-body-size", default="16MiB", help="request body limit (413 above)")
    serve.add_argument(
        "--graceful-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on shutdown",
    )
    limits = serve.add_argument_group("what one request may cost")
    limits.add_argument(
        "--max-choices-per-request",
        type=int,
        default=2048,
        help="choices (prompts x n) of one request; more is a 400",
    )
    limits.add_argument(
        "--max-logprob-entries",
        type=int,
        default=1 << 20,
        help="logprob entries (positions x (1 + alternatives)) a whole, not streamed, answer "
        "may hold; more is a 400",
    )
    limits.add_argument(
        "--max-prompt-embeds-bytes",
        default="256MiB",
        help="decoded prompt_embeds of one request, counted once per choice; more is a 400",
    )
    serve.add_argument(
        "--health-stall-timeout",
        type=float,
        default=60.0,
        help="seconds without an engine step, with requests pending, before /health is 503",
    )
    tools = serve.add_argument_group("tools (the Responses API's MCP tools)")
    tools.add_argument(
        "--tool-server",
        action="append",
        default=[],
        metavar="URL[,URL...]",
        help="an MCP server whose tools /v1/responses may use (repeatable, or comma-separated)",
    )
    tools.add_argument(
        "--allow-request-tool-servers",
        action="store_true",
        help="let a request name an MCP server_url that is not configured here",
    )
    tools.add_argument(
        "--allow-private-tool-servers",
        action="store_true",
        help="let such a server_url resolve to a loopback, private, link-local or metadata "
        "address (refused by default)",
    )
    tools.add_argument(
        "--tool-call-timeout",
        type=float,
        default=30.0,
        help="seconds an MCP tool call may take before it is an error for the model",
    )
    tools.add_argument(
        "--max-tool-turns",
        type=int,
        default=8,
        help="rounds of MCP tool calls per response; then the model answers without tools",
    )
    stored = serve.add_argument_group("stored responses (/v1/responses)")
    stored.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="responses kept for retrieval and previous_response_id; the oldest finished go first",
    )
    stored.add_argument(
        "--max-background-responses",
        type=int,
        default=32,
        help="background responses queued or running at once; past it a new one is a 429",
    )
    stored.add_argument(
        "--response-ttl",
        type=float,
        default=3600.0,
        help="seconds a finished stored response is kept",
    )
    engine = serve.add_argument_group("engine")
    engine.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    engine.add_argument(
        "--quantization",
        default=None,
        choices=["auto", "none"],
        help="auto (default): run a GGUF file's 4-bit projections as stored where a kernel "
        "exists (CPU, bfloat16) for small steps; none: dequantized weights only",
    )
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument(
        "--max-new-prompt-tokens",
        type=int,
        default=None,
        help="prompt tokens a step starts new requests with, the first request's whatever it "
        "takes (default 256; 0: up to --max-num-batched-tokens)",
    )
    engine.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="requests that may wait to start; past it a new one gets 429 with Retry-After "
        "(default 4096; 0: no bound)",
    )
    engine.add_argument("--kv-cache-memory", default=None, help="e.g. 512MiB, 2GiB")
    engine.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None
    )
    engine.add_argument("--seed", type=int, default=None)
    engine.add_argument(
        "--record-wire",
        default=None,
        metavar="DIR",
        help="record every message the engine core takes in and sends out into DIR (a new "
        "directory; 8 rotating files of 64 MiB at most), for `triode replay DIR`",
    )
    parallel = serve.add_argument_group("parallelism (one worker process per rank)")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    parallel.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None)
    parallel.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "inproc"],
        default=None,
        help="mp: a worker process per rank; inproc: the model in the engine core (world of "
        "one only; the default there)",
    )
    parallel.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=None,
        help="engine cores, each with its own KV cache (and model workers), that requests are "
        "balanced over",
    )
    parallel.add_argument("--nnodes", type=int, default=None, help="nodes the ranks span")
    parallel.add_argument("--node-rank", type=int, default=None, help="this node's index")
    parallel.add_argument(
        "--master-addr", default=None, help="rendezvous host: node 0 (default 127.0.0.1)"
    )
    parallel.add_argument("--master-port", type=int, default=None, help="rendezvous port")
    parallel.add_argument(
        "--cluster-key-file",
        default=None,
        metavar="PATH",
        help="several nodes: the CurveZMQ key every node shares, 0600 (make one with "
        "`triode cluster-key PATH`)",
    )
    parallel.add_argument(
        "--distributed-timeout",
        type=float,
        default=None,
        help="seconds a collective waits for a peer before the engine fails (default 30)",
    )
    serve.add_argument(
        "--kv-transfer-config",
        default=None,
        metavar="JSON",
        help='disaggregated prefill, as vLLM spells it: \'{"kv_connector": "TriodeConnector", '
        '"kv_role": "kv_producer|kv_consumer|kv_both", "kv_port": 0, '
        '"kv_connector_extra_config": {"transport": "tcp|shm", "secret_file": PATH}}\'',
    )
    parallel.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's model workers (nodes other than 0), no API server",
    )


ENGINE_FLAGS = (
    "dtype",
    "quantization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_new_prompt_tokens",
    "max_waiting_requests",
    "kv_cache_memory",
    "enable_prefix_caching",
    "tensor_parallel_size",
    "seed",
    "pipeline_parallel_size",
    "distributed_executor_backend",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "distributed_timeout",
    "kv_transfer_config",
    "data_parallel_size",
    "record_wire",
    "cluster_key_file",
)


def _run_serve(args: argparse.Namespace) -> int:
    import trio

    from triode.actors.config import parse_size

    from .auth import ApiKeys, keys_from
    from .server import ServeOptions, serve
    from .settings import Settings
    from .tools.mcp import parse_tool_server_specs

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # the engine core process logs (model loading, its progress) at the same level
    os.environ.setdefault("TRIODE_LOG_LEVEL", args.log_level.upper())
    engine_args = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.kv_transfer_config is not None:
        from triode.wire.kv_transfer import parse_kv_transfer_config

        # before any process starts: a config or secret that cannot serve is one line
        try:
            parse_kv_transfer_config(args.kv_transfer_config).read_secret()
        except ValueError as e:
            print(f"triode serve: {e}", file=sys.stderr)
            return 2
    if args.headless:
        return _run_headless(args.model, engine_args)
    if engine_args.get("node_rank", 0) != 0:
        raise SystemExit("triode serve: --node-rank other than 0 runs with --headless")
    if _cluster_key_refused(engine_args):
        return 2
    keys = keys_from(args.api_key, os.environ)
    max_body = parse_size(args.max_body_size)
    max_prompt_embeds = parse_size(args.max_prompt_embeds_bytes)
    if min(args.max_choices_per_request, args.max_logprob_entries, max_prompt_embeds) < 1:
        raise SystemExit(
            "triode serve: --max-choices-per-request, --max-logprob-entries and "
            "--max-prompt-embeds-bytes must be >= 1"
        )
    if not args.health_stall_timeout > 0:
        raise SystemExit("triode serve: --health-stall-timeout must be positive")
    if args.tool_call_timeout <= 0:
        raise SystemExit("triode serve: --tool-call-timeout must be positive")
    if args.max_tool_turns < 0:
        raise SystemExit("triode serve: --max-tool-turns must not be negative")
    if args.max_stored_responses < 1 or args.max_background_responses < 1:
        raise SystemExit(
            "triode serve: --max-stored-responses and --max-background-responses must be >= 1"
        )
    if not args.response_ttl > 0:
        raise SystemExit("triode serve: --response-ttl must be positive")
    if not 1 <= args.api_server_count <= 64:
        raise SystemExit("triode serve: --api-server-count must be between 1 and 64")
    if args.prefix_cache_isolation == "key" and not keys:
        raise SystemExit(
            "triode serve: --prefix-cache-isolation key needs API keys to tell tenants apart "
            "(--api-key or TRIODE_API_KEY)"
        )
    try:
        tool_servers = [s for v in args.tool_server for s in parse_tool_server_specs(v)]
    except ValueError as e:
        raise SystemExit(f"triode serve: --tool-server: {e}") from None

    def settings(engine: object) -> Settings:
        names = args.served_model_names or [_default_name(args.model, engine)]
        return Settings(
            served_model_names=names,
            api_keys=ApiKeys(keys),
            max_body_size=max_body,
            prefix_cache_isolation=args.prefix_cache_isolation,
            allowed_origins=args.allowed_origins,
            tool_servers=tool_servers,
            allow_request_tool_servers=args.allow_request_tool_servers,
            tool_call_timeout=args.tool_call_timeout,
            max_tool_turns=args.max_tool_turns,
            max_choices_per_request=args.max_choices_per_request,
            max_logprob_entries=args.max_logprob_entries,
            max_prompt_embeds_bytes=max_prompt_embeds,
            health_stall_timeout=args.health_stall_timeout,
            max_stored_responses=args.max_stored_responses,
            metrics_require_key=args.metrics_require_key,
            max_background_responses=args.max_background_responses,
            response_ttl=args.response_ttl,
            allow_private_tool_servers=args.allow_private_tool_servers,
        )

    if keys:
        logging.getLogger("triode.serve").info("API keys required: %d configured", len(keys))
    options = ServeOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        root_path=args.root_path,
        graceful_timeout=args.graceful_timeout,
        api_server_count=args.api_server_count,
    )
    trio.run(serve, options, settings, engine_args)
    return 0


def _run_headless(model: str | None, engine_args: dict[str, object]) -> int:
    import trio

    from triode.actors.config import EngineArgs
    from triode.actors.headless import serve_headless

    try:
        args = EngineArgs(model=model, **engine_args)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise SystemExit(f"triode serve --headless: {e}") from None
    if args.node_rank == 0:
        raise SystemExit("triode serve --headless: node 0 runs the engine core; give --node-rank")
    if _cluster_key_refused(engine_args):
        return 2
    trio.run(serve_headless, args)
    return 0


def _proxy_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    proxy = commands.add_parser(
        "proxy",
        help="route requests over prefill and decode instances (disaggregated prefill)",
        description="Serve the OpenAI API by prefilling each request on a prefill instance and "
        "decoding it, with the prefill's KV, on a decode instance; each kind in turn.",
    )
    for kind, port in (("prefill", 8100), ("decode", 8200)):
        proxy.add_argument(
            f"--{kind}",
            action="extend",
            nargs="+",
            required=True,
            metavar="URL",
            help=f"a {kind} instance's base URL, e.g. http://127.0.0.1:{port} (repeatable)",
        )
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=None,
        help="accept this key (repeatable; also TRIODE_API_KEY, comma-separated)",
    )
    proxy.add_argument(
        "--kv-secret-file",
        required=True,
        metavar="PATH",
        help="the deployment's secret, the file the instances' kv_connector_extra_config "
        "secret_file names: it seals the proxy's requests to the prefill instances",
    )
    proxy.add_argument(
        "--backend-api-key",
        default=None,
        help="the key sent to the instances (default: none)",
    )
    proxy.add_argument(
        "--forward-client-key",
        action="store_true",
        help="send the client's Authorization on to the instances (off by default: a key to "
        "the proxy is not one to the instances)",
    )
    proxy.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for each read from an instance (connecting: 5)",
    )
    proxy.add_argument("--max-body-size", default="16MiB", help="request body limit (413 above)")
    proxy.add_argument(
        "--graceful-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on shutdown",
    )
    proxy.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )


def _run_proxy(args: argparse.Namespace) -> int:
    import trio

    from triode.actors.config import parse_size
    from triode.wire.kv_seal import read_secret

    from .auth import ApiKeys, keys_from
    from .proxy import ProxyOptions, serve_proxy

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":  # httpx logs every request to an instance at info
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    keys = keys_from(args.api_key, os.environ)
    try:
        options = ProxyOptions(
            prefill=args.prefill,
            decode=args.decode,
            host=args.host,
            port=args.port,
            api_keys=ApiKeys(keys),
            backend_api_key=args.backend_api_key,
            timeout=args.timeout,
            max_body_size=parse_size(args.max_body_size),
            graceful_timeout=args.graceful_timeout,
            kv_secret=read_secret(args.kv_secret_file),
            forward_client_key=args.forward_client_key,
        )
    except ValueError as e:
        print(f"triode proxy: {e}", file=sys.stderr)
        return 2
    if keys:
        logging.getLogger("triode.proxy").info("API keys required: %d configured", len(keys))
    trio.run(serve_proxy, options)
    return 0


def _replay_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    replay = commands.add_parser(
        "replay",
        help="replay a --record-wire recording against a new engine and compare its outputs",
        description="Start an engine core with the recorded engine arguments, send it the "
        "recorded inputs at their recorded pace, and compare each request's tokens and finish "
        "reason with the recording. Exit status 0 when they agree, 1 when they differ.",
    )
    replay.add_argument("directory", metavar="DIR", help="a --record-wire directory")
    replay.add_argument("--model", default=None, help="this model instead of the recorded one")
    replay.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="how many times faster than recorded to send the inputs (inf: at once)",
    )
    replay.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="give up waiting for the outputs after this long (exit status 1)",
    )
    replay.add_argument("--json", action="store_true", help="print the report as JSON")
    replay.add_argument(
        "--trust-recorded-args",
        action="store_true",
        help="take the recording's multi-node and KV-transfer arguments (nnodes, node_rank, "
        "master_addr, master_port, cluster_key_file, kv_transfer_config) too; refused by default",
    )
    replay.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )


def _run_replay(args: argparse.Namespace) -> int:
    import msgspec
    import trio

    from triode.actors.replay import UntrustedRecordingError, replay
    from triode.wire import ProtocolError

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TRIODE_LOG_LEVEL", args.log_level.upper())
    if not args.speed > 0:
        raise SystemExit("triode replay: --speed must be positive")
    try:
        report = trio.run(
            partial(
                replay,
                args.directory,
                model=args.model,
                speed=args.speed,
                max_seconds=args.max_seconds,
                trust_recorded_args=args.trust_recorded_args,
            )
        )
    except (
        FileNotFoundError, ProtocolError, msgspec.ValidationError, UntrustedRecordingError
    ) as e:  # fmt: skip
        raise SystemExit(f"triode replay: {args.directory}: {e}") from None
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(
            f"{report.identical} request(s) identical, {len(report.differences)} differ"
            f" ({report.inputs} inputs in {report.seconds:.1f} s"
            f"{', timed out' if report.timed_out else ''})"
        )
        for d in report.differences:
            print(
                f"  {d.request_id}: at {d.index} recorded {d.recorded!r}, replayed {d.replayed!r}"
            )
    return 0 if report.ok else 1


def _cluster_key_refused(engine_args: dict[str, object]) -> bool:
    """Several nodes without a usable cluster key: one line, before any process starts."""
    from triode.wire.cluster_key import ClusterKey, ClusterKeyError

    nnodes, path = engine_args.get("nnodes", 1), engine_args.get("cluster_key_file")
    try:
        ClusterKey.for_world(nnodes != 1, None if path is None else str(path))
    except ClusterKeyError as e:
        print(f"triode serve: {e}", file=sys.stderr)
        return True
    return False


def _make_cluster_key(path: str) -> int:
    from triode.wire.cluster_key import ClusterKey

    try:
        ClusterKey.generate().write(path)
    except OSError as e:
        print(f"triode cluster-key: {path}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {path}: give every node the same file with --cluster-key-file {path}")
    return 0


def _default_name(model: str | None, engine: object) -> str:
    """The name the API answers to: what was given on the command line, else the model's."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model)).removesuffix(".gguf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triode", description="LLM inference on trio actors")
    parser.add_argument("--version", action="version", version=f"triode {version('triode')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(commands)
    _proxy_parser(commands)
    _replay_parser(commands)
    cluster_key = commands.add_parser(
        "cluster-key",
        help="make the key file that the nodes of a multi-node world share",
        description="Write a new CurveZMQ key to PATH (created 0600; never over an existing "
        "file). Copy it to every node and give it to each `triode serve` with "
        "--cluster-key-file PATH.",
    )
    cluster_key.add_argument("path", metavar="PATH")
    bench = commands.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("which", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    fuzz = commands.add_parser(
        "fuzz",
        help="fuzz a live server (HTTP) or engine core (ZMQ)",
        description="Send hostile traffic for a while, checking invariants between rounds; "
        "exit status 1 on a violation. `triode fuzz MODE --help` lists the options.",
    )
    fuzz.add_argument("mode", choices=["http", "zmq", "all", "replay"])
    fuzz.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the fuzzer")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.command == "serve":
        args.served_model_names = args.served_model_name
        return _run_serve(args)
    if args.command == "proxy":
        return _run_proxy(args)
    if args.command == "cluster-key":
        return _make_cluster_key(args.path)
    if args.command == "replay":
        return _run_replay(args)
    if args.command == "fuzz":
        return importlib.import_module("triode.fuzz.live").main([args.mode, *args.args])
    if args.command == "bench":
        importlib.import_module(BENCHMARKS[args.which]).main(args.args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
