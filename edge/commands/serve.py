"""`triode serve`: its options (the engine's built from `EngineArgs`, `engine_flags.py`), and
the checks that turn a command line that cannot serve into one line before any process starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from typing import Any

import trio

from triode.actors import (
    EngineArgs,
    EngineCoreFailed,
    EngineCoreStartError,
    parse_size,
    serve_headless,
)
from triode.wire.cluster_key import ClusterKey, ClusterKeyError
from triode.wire.kv_transfer import parse_kv_transfer_config

from ..errors import leaf_errors
from .engine_flags import add_engine_flags, given_engine_args, kv_cache_check_flags


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`triode serve` and its options."""
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
        "--enable-admin-api",
        action="store_true",
        help="serve the administrative routes (/sleep, /wake_up, /pause, /resume, "
        "/reset_prefix_cache, /start_profile, /stop_profile, weight updates, /get_world_size, "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter); behind the API key when keys are set",
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
        "--max-stored-response-bytes",
        default="256MiB",
        help="what the stored finished responses may hold in all, as JSON (default 256MiB); "
        "past it the least recently used go first",
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
    parallel = serve.add_argument_group("parallelism (one worker process per rank)")
    add_engine_flags({"engine": engine, "parallelism": parallel, "options": serve})
    parallel.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's model workers (nodes other than 0), no API server",
    )


def run(args: argparse.Namespace) -> int:
    """Run `triode serve` as parsed; the exit status.

    The server's modules are imported here, when serving, not when the parser is built: the app,
    the server and the tool servers' client take 1.5 to 2 s to import, which `triode --help`
    and the other subcommands need not pay.
    """
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # the engine core process logs (model loading, its progress) at the same level
    os.environ.setdefault("TRIODE_LOG_LEVEL", args.log_level.upper())
    engine_args = given_engine_args(args)
    if args.kv_transfer_config is not None:
        # before any process starts: a config or secret that cannot serve is one line
        try:
            parse_kv_transfer_config(args.kv_transfer_config).read_secret()
        except ValueError as e:
            print(f"triode serve: {e}", file=sys.stderr)
            return 2
    if args.headless:
        if _model_refused(args.model, engine_args):
            return 2
        return _run_headless(args.model, engine_args)
    if engine_args.get("node_rank", 0) != 0:
        raise SystemExit("triode serve: --node-rank other than 0 runs with --headless")
    # before the server's imports, which take longer than the check
    if _model_refused(args.model, engine_args):
        return 2
    from ..app import default_served_model_name
    from ..auth import ApiKeys, keys_from
    from ..lora_names import lora_modules_problem
    from ..server import ServeOptions, serve
    from ..settings import Settings
    from ..tools.mcp import parse_tool_server_specs

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
    try:
        stored_bytes = parse_size(args.max_stored_response_bytes)
    except ValueError as e:
        raise SystemExit(f"triode serve: --max-stored-response-bytes: {e}") from None
    if stored_bytes < 1:
        raise SystemExit("triode serve: --max-stored-response-bytes must be positive")
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
    names = args.served_model_name or [default_served_model_name(args.model)]
    problem = lora_modules_problem(engine_args.get("lora_modules", []), names)
    if problem is not None:
        print(f"triode serve: {problem}", file=sys.stderr)
        return 2

    def settings(engine: object) -> Settings:
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
            max_stored_response_bytes=stored_bytes,
            metrics_require_key=args.metrics_require_key,
            max_background_responses=args.max_background_responses,
            response_ttl=args.response_ttl,
            allow_private_tool_servers=args.allow_private_tool_servers,
            enable_admin_api=args.enable_admin_api,
        )

    serve_log = logging.getLogger("triode.serve")
    if keys:
        serve_log.info("API keys required: %d configured", len(keys))
    if args.enable_admin_api and not keys:
        serve_log.warning(
            "--enable-admin-api without API keys: anyone who reaches %s:%d can put the engine "
            "to sleep, pause it, replace its weights or load adapters (set --api-key or "
            "TRIODE_API_KEY)",
            args.host,
            args.port,
        )
    if (
        engine_args.get("enable_lora")
        and args.enable_admin_api
        and not engine_args.get("allowed_lora_paths")
    ):
        serve_log.info(
            "--enable-lora with --enable-admin-api and no --allowed-lora-paths: "
            "/v1/load_lora_adapter loads only the --lora-modules paths; the engine refuses "
            "any other (give --allowed-lora-paths DIR to allow those under DIR)"
        )
    options = ServeOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        root_path=args.root_path,
        graceful_timeout=args.graceful_timeout,
        api_server_count=args.api_server_count,
    )
    return _run_server(serve, options, settings, engine_args)


def _run_server(serve: Any, *args: Any) -> int:
    """`trio.run(serve, *args)`; an engine core that fails to start is one line on stderr and
    exit status 2, its traceback a debug log (`--log-level debug`). A SIGINT that finds no
    graceful shutdown to start (a second one while the engine core stops, as `timeout` and
    process managers send, or one during start-up) stops everything at once: one log line, no
    traceback, exit status 130 (the shell's for SIGINT); the engine cores and workers are ended
    on the way out. An engine core that dies past its restart budget is one line and exit
    status 1."""
    failed: BaseExceptionGroup | None = None
    interrupted = False
    gave_up: list[str] = []
    try:
        trio.run(serve, *args)
    except* EngineCoreStartError as group:
        failed = group
    except* EngineCoreFailed as group:
        gave_up = [e.line for e in leaf_errors(group) if isinstance(e, EngineCoreFailed)]
    except* KeyboardInterrupt:
        interrupted = True
    if interrupted:
        logging.getLogger("triode.serve").info("interrupted: stopped at once")
        return 130
    if gave_up:
        print(f"triode serve: {gave_up[0]}", file=sys.stderr)
        return 1
    if failed is None:
        return 0
    logging.getLogger("triode.serve").debug("the engine core's start", exc_info=failed)
    summary = EngineCoreStartError.summary(failed)
    print(f"triode serve: engine core failed to start: {summary}", file=sys.stderr)
    return 2


def _run_headless(model: str | None, engine_args: dict[str, object]) -> int:
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


def _model_refused(model: str | None, engine_args: dict[str, object]) -> bool:
    """A model that cannot serve, as far as its files tell: one line, before any process
    starts."""
    problem = model_problem(model, engine_args)
    if problem is not None:
        print(f"triode serve: {problem}", file=sys.stderr)
    return problem is not None


def model_problem(model: str | None, engine_args: dict[str, object]) -> str | None:
    """Why `model` cannot be served, as far as its files tell without loading it (the
    architecture, config.json's sizes, the weights' shapes, the generation config flags, a KV
    cache too small for the context length asked for), or None. The model process's side of
    triode, which the edge does not import, checks: its check costs a tenth of a second, the
    engine core's failure several seconds and a traceback (after a GGUF file's conversion)."""
    command = [sys.executable, "-m", "triode.gpu.checks.model", *([] if model is None else [model])]
    for flag in ("generation_config", "override_generation_config"):
        value = engine_args.get(flag)
        if value is not None:
            text = value if isinstance(value, str) else json.dumps(value)
            command += [f"--{flag.replace('_', '-')}", text]
    command += kv_cache_check_flags(engine_args)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    if done.returncode == 2 and len(lines) == 1:
        return lines[0]
    # the check itself failed: the engine core will say what is wrong, if anything is
    logging.getLogger("triode.serve").warning(
        "the model check failed (exit status %d): %s", done.returncode, done.stderr.strip()
    )
    return None


def _cluster_key_refused(engine_args: dict[str, object]) -> bool:
    """Several nodes without a usable cluster key: one line, before any process starts."""
    nnodes, path = engine_args.get("nnodes", 1), engine_args.get("cluster_key_file")
    try:
        ClusterKey.for_world(nnodes != 1, None if path is None else str(path))
    except ClusterKeyError as e:
        print(f"triode serve: {e}", file=sys.stderr)
        return True
    return False
