"""A torch profile of this rank, from `start` to `stop`, written as a Chrome trace.

torch's profiler is thread-local by default: started on one thread it records the operators of
that thread only, and stopping it on another thread fails (torch 2.13: "disableProfiler called
but no active profiling session found", and a leaked callback). The in-process executor runs
administrative calls and steps on whichever thread of trio's pool is free, so the profile is
started with `profile_all_threads`: it records every thread's operators, started and stopped
from any thread (tests/gpu/test_operations.py pins that a step on another thread is in the
trace).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from triode.wire import OperationError

# the longest file name prefix; a prefix holds no separators or control characters, so the
# trace lands in the profile directory and nowhere else
MAX_PREFIX = 128


class Profiler:
    """At most one profile at a time, of every thread of this process, for rank `rank`."""

    def __init__(self, device: torch.device, rank: int) -> None:
        self.device, self.rank = device, rank
        self._profile: profile | None = None
        self._path: Path | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, directory: str, prefix: str) -> Path:
        """Start recording; returns the file `stop` will write. OperationError `conflict`
        while a profile runs, `invalid` for a prefix that is no plain file name prefix or a
        directory that cannot be created or written."""
        if self._profile is not None:
            raise OperationError("conflict", "a profile is running already: stop_profile first")
        if (
            len(prefix) > MAX_PREFIX
            or "/" in prefix
            or "\\" in prefix
            or prefix in (".", "..")
            or not prefix.isprintable()
        ):
            raise OperationError(
                "invalid", f"prefix {prefix!r} is not a file name prefix of at most {MAX_PREFIX}"
            )
        folder = Path(directory).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OperationError("invalid", f"profile directory {directory!r}: {e}") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise OperationError("invalid", f"profile directory {directory!r} is not writable")
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        recording = profile(
            activities=activities,
            record_shapes=True,
            with_stack=True,
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )
        recording.start()
        self._profile, self._path = recording, folder / f"{prefix}rank-{self.rank}.json"
        return self._path

    def stop(self) -> Path:
        """Stop recording and write the trace; returns its path. OperationError `conflict`
        when no profile runs. The file appears whole (written beside it, then renamed)."""
        recording, path = self._profile, self._path
        if recording is None or path is None:
            raise OperationError("conflict", "no profile is running: start_profile first")
        self._profile = self._path = None
        recording.stop()
        # a file of its own (O_EXCL): a link someone left at a fixed name is not written through
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        os.close(fd)
        try:
            recording.export_chrome_trace(partial)
            os.replace(partial, path)
        finally:
            Path(partial).unlink(missing_ok=True)
        return path
