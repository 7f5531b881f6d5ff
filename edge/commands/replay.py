"""`triode replay`: its options, and the report of a replay against a `--record-wire` recording."""

from __future__ import annotations

import argparse
import logging
import os
from functools import partial

import msgspec
import trio

from triode.actors import UntrustedRecordingError
from triode.actors import replay as replay_recording
from triode.wire import ProtocolError


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`triode replay` and its options."""
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


def run(args: argparse.Namespace) -> int:
    """Run `triode replay` as parsed; the exit status (1: the outputs differ)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TRIODE_LOG_LEVEL", args.log_level.upper())
    if not args.speed > 0:
        raise SystemExit("triode replay: --speed must be positive")
    try:
        report = trio.run(
            partial(
                replay_recording,
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
