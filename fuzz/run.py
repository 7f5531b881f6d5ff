"""Run the fuzz harnesses.

```sh
python -m triode.fuzz.run [HARNESS...] --seconds N --seed S [--corpus DIR] [--atheris]
python -m triode.fuzz.run --reproduce fuzz/crashes/http_body-0123abcd.bin
```

Each named harness (all of them by default) runs for N seconds over its seed corpus
(`<corpus>/<harness>/`): every seed as it is, then mutants. The built-in engine
(`triode.fuzz.mutator`) is deterministic for a fixed seed. With `--atheris` and atheris installed
(`pip install -e '.[fuzz]'`), libFuzzer drives a coverage-instrumented harness instead, one
process per harness. An input that runs longer than `--timeout` seconds counts as a failure
(a hang). A failing input is written to `<crashes>/<harness>-<sha>.bin`, its traceback printed,
and the exit status is 1; `--reproduce FILE` runs one such input again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType

from .harnesses import HARNESSES, load
from .mutator import Mutator, libfuzzer_dictionary

HERE = Path(__file__).resolve().parent
CORPUS_DIR = HERE / "corpus"
CRASH_DIR = HERE / "crashes"
DEFAULT_TIMEOUT = 10.0

Target = Callable[[bytes], None]


class InputTimeout(BaseException):
    """An input ran past the per-input time limit. A BaseException, so that no harness's
    `except Exception` can swallow it."""


@dataclasses.dataclass
class Failure:
    data: bytes
    traceback: str
    path: Path | None = None


@dataclasses.dataclass
class Result:
    harness: str
    executions: int
    seconds: float
    failure: Failure | None = None

    @property
    def rate(self) -> float:
        return self.executions / self.seconds if self.seconds > 0 else 0.0


def read_corpus(directory: Path) -> list[bytes]:
    """The seed inputs in `directory`, in file name order (none if it does not exist)."""
    if not directory.is_dir():
        return []
    return [path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()]


def fuzz(
    harness: str,
    target: Target,
    seeds: Sequence[bytes],
    *,
    seconds: float,
    seed: int = 0,
    max_runs: int | None = None,
    dictionary: Sequence[bytes] = (),
    timeout: float = DEFAULT_TIMEOUT,
    crash_dir: Path | None = CRASH_DIR,
) -> Result:
    """Run `target` on the seeds, then on mutants, for `seconds` (or `max_runs` inputs), and
    stop at the first failure, which is written to `crash_dir` unless that is None."""
    inputs = Mutator(random.Random(seed), seeds, dictionary)
    start = time.perf_counter()
    deadline = start + seconds
    executions = 0
    for data in inputs:
        if time.perf_counter() >= deadline or (max_runs is not None and executions >= max_runs):
            break
        failed = run_input(target, data, timeout)
        executions += 1
        if failed is not None:
            failure = Failure(data, failed)
            if crash_dir is not None:
                failure.path = save_crash(crash_dir, harness, data)
            return Result(harness, executions, time.perf_counter() - start, failure)
    return Result(harness, executions, time.perf_counter() - start)


def run_input(target: Target, data: bytes, timeout: float = DEFAULT_TIMEOUT) -> str | None:
    """None if `target(data)` returns within `timeout` seconds, else the failure's traceback."""
    try:
        with _time_limit(timeout):
            target(data)
    except (Exception, InputTimeout):
        return traceback.format_exc()
    return None


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread: no limit elsewhere
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise InputTimeout(f"the input ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def save_crash(crash_dir: Path, harness: str, data: bytes) -> Path:
    crash_dir.mkdir(parents=True, exist_ok=True)
    path = crash_dir / f"{harness}-{hashlib.sha256(data).hexdigest()[:16]}.bin"
    path.write_bytes(data)
    return path


# libFuzzer through atheris


def atheris_available() -> bool:
    try:
        importlib.import_module("atheris")
    except ImportError:
        return False
    return True


def fuzz_with_atheris(
    harness: str,
    corpus_dir: Path,
    *,
    seconds: float,
    seed: int,
    timeout: float,
    crash_dir: Path,
) -> Result:
    """One libFuzzer run of `harness` in a child process; new inputs it finds stay in a
    temporary directory, so the committed corpus is only read."""
    crash_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"{harness}-libfuzzer-"
    with tempfile.TemporaryDirectory(prefix=f"triode-fuzz-{harness}-") as work:
        dictionary = Path(work) / "dictionary"
        dictionary.write_text(libfuzzer_dictionary(getattr(load(harness), "DICTIONARY", ())))
        corpus = Path(work) / "corpus"
        corpus.mkdir()
        args = [
            f"-max_total_time={max(int(seconds), 1)}",
            f"-seed={seed + 1}",  # libFuzzer's 0 means "pick one at random"
            f"-timeout={max(int(timeout), 1)}",
            f"-artifact_prefix={crash_dir}/{prefix}",
            f"-dict={dictionary}",
            "-print_final_stats=1",
            str(corpus),
            str(corpus_dir / harness),
        ]
        command = [sys.executable, "-m", "triode.fuzz.run", "--atheris-worker", harness, *args]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, errors="replace")
        elapsed = time.perf_counter() - start
    output = done.stdout + done.stderr
    runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", output)
    result = Result(harness, int(runs.group(1)) if runs else 0, elapsed)
    artifacts = sorted(crash_dir.glob(f"{prefix}*"))
    if done.returncode != 0 or artifacts:
        data = artifacts[0].read_bytes() if artifacts else b""
        failure = Failure(data, output[-20_000:])
        for artifact in artifacts:
            failure.path = save_crash(crash_dir, harness, artifact.read_bytes())
            artifact.unlink()
        result.failure = failure
    return result


def _atheris_worker(harness: str, libfuzzer_args: list[str]) -> None:
    # an optional dependency (the fuzz extra): only this worker process needs it
    import atheris

    with atheris.instrument_imports(include=["triode"]):
        module = load(harness)
    atheris.Setup([sys.argv[0], *libfuzzer_args], module.test_one_input)
    atheris.Fuzz()


# The command line


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--atheris-worker"]:
        _atheris_worker(argv[1], argv[2:])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m triode.fuzz.run", description="Run triode's fuzz harnesses."
    )
    parser.add_argument("harnesses", nargs="*", metavar="HARNESS", help=", ".join(HARNESSES))
    parser.add_argument("--seconds", type=float, default=60.0, help="per harness (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=None, help="stop a harness after N inputs")
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="seed corpora root")
    parser.add_argument("--crashes", type=Path, default=CRASH_DIR, help="where failures go")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="per input (s)")
    parser.add_argument("--atheris", action="store_true", help="use libFuzzer via atheris")
    parser.add_argument("--reproduce", type=Path, metavar="FILE", help="run one input again")
    args = parser.parse_args(argv)
    unknown = [name for name in args.harnesses if name not in HARNESSES]
    if unknown:
        parser.error(f"unknown harness {', '.join(unknown)}; choose from {', '.join(HARNESSES)}")
    if args.reproduce is not None:
        return _reproduce(parser, args.reproduce, args.harnesses, args.timeout)

    use_atheris = args.atheris and atheris_available()
    if args.atheris and not use_atheris:
        print("atheris is not installed (pip install -e '.[fuzz]'): using the built-in engine")
    failures = []
    for name in args.harnesses or HARNESSES:
        if use_atheris:
            result = fuzz_with_atheris(
                name,
                args.corpus,
                seconds=args.seconds,
                seed=args.seed,
                timeout=args.timeout,
                crash_dir=args.crashes,
            )
        else:
            module = load(name)
            result = fuzz(
                name,
                module.test_one_input,
                read_corpus(args.corpus / name),
                seconds=args.seconds,
                seed=args.seed,
                max_runs=args.runs,
                dictionary=getattr(module, "DICTIONARY", ()),
                timeout=args.timeout,
                crash_dir=args.crashes,
            )
        status = "ok" if result.failure is None else "FAILED"
        print(
            f"{name:<10} {result.executions:>9} executions in {result.seconds:6.1f} s"
            f" {result.rate:>9.0f}/s  {status}",
            flush=True,
        )
        if result.failure is not None:
            failures.append(result)
    for result in failures:
        failure = result.failure
        assert failure is not None
        print(f"\n{result.harness} failed; reproducer: {failure.path}\n{failure.traceback}")
    return 1 if failures else 0


def _reproduce(
    parser: argparse.ArgumentParser, path: Path, names: list[str], timeout: float
) -> int:
    if len(names) > 1:
        parser.error("--reproduce takes one harness")
    name = names[0] if names else path.name.rsplit("-", 1)[0]
    if name not in HARNESSES:
        parser.error(f"cannot tell the harness from {path.name}; name it")
    failed = run_input(load(name).test_one_input, path.read_bytes(), timeout)
    if failed is None:
        print(f"{name}: {path} passes")
        return 0
    print(f"{name}: {path} fails\n{failed}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
