"""`triode proxy`: its options, and the `ProxyOptions` they make (`edge/proxy.py` serves them)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import trio

from triode.actors import parse_size
from triode.wire.kv_seal import read_secret


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`triode proxy` and its options."""
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


def run(args: argparse.Namespace) -> int:
    """Run `triode proxy` as parsed; the exit status."""
    # imported when proxying, not when the parser is built: the proxy takes about 0.3 s to
    # import, which `triode --help` and the other subcommands need not pay
    from ..auth import ApiKeys, keys_from
    from ..proxy import ProxyOptions, serve_proxy

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
    interrupted = False
    try:
        trio.run(serve_proxy, options)
    except* KeyboardInterrupt:  # a second SIGINT, or one before the proxy drains
        interrupted = True
    if interrupted:
        logging.getLogger("triode.proxy").info("interrupted: stopped at once")
        return 130
    return 0
