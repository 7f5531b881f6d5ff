"""A warm fork server for actor processes: the model's imports paid once, not once per process.

An actor process started with `python -m triode.actors` imports torch, transformers and triode
before it does anything: 2-3 s of CPU per engine core or model worker. A fork server is a
process that imported them once, is single-threaded, and forks a child per request; the child
runs the same `triode.actors.child.main` an executed one does. `open_child` uses the fork server
named by `$TRIODE_FORKSERVER` (a Unix socket path) when there is one, and executes the child as
before when there is none, when the server refuses, or when it cannot be reached.

The server forks only for a requester whose environment agrees with its own on every variable
that a library reads once, at load (OpenMP and allocator settings, `PYTHONPATH`, torch's and
Hugging Face's settings, ...: `LOAD_TIME_PREFIXES`); the child takes every other variable from
the request. What the child read at load is then what an executed child would have read. It
gets the requester's working directory, standard output and error (passed as descriptors), CPU
affinity and a session of its own, and watches the requester, not the server, as its parent.
The server reports each child's exit status to the requester on the request's connection; the
requester signals the child through a pidfd it opened before the server may reap it, so a
signal never reaches a reused pid.

Who can reach it: the socket is created in a directory of mode 0700 and the server accepts only
peers of its own user (SO_PEERCRED); a request is at most `MAX_REQUEST` bytes.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import importlib
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import trio

log = logging.getLogger(__name__)

ENV = "TRIODE_FORKSERVER"
# What every actor process of a model imports: the actor runtime, the engine core, the worker.
PRELOAD = ("triode.actors.child", "triode.actors.core.main", "triode.gpu.worker")
# Read when a library loads (OpenMP, BLAS, the allocator, the dynamic linker, the interpreter,
# torch, Hugging Face's libraries, the locale) or cached by a preloaded module (home and temporary
# directories): a child forked for a request that sets any of these differently would run with
# the server's values, so such a request is executed instead. Every other variable is read when
# used, and a forked child takes the request's.
LOAD_TIME_PREFIXES = (
    "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_", "DNNL_", "ONEDNN_", "MALLOC_",
    "GLIBC_", "LD_", "PYTHON", "TORCH_", "PYTORCH_", "CUDA_", "NCCL_", "HF_", "HUGGINGFACE_",
    "TRANSFORMERS_", "TOKENIZERS_", "LC_",
)  # fmt: skip
LOAD_TIME_NAMES = frozenset({"LANG", "HOME", "XDG_CACHE_HOME", "TMPDIR", "TEMP", "TMP"})
MAX_REQUEST = 1 << 20
_LEN = struct.Struct("!I")


class Request(msgspec.Struct, frozen=True):
    argv: list[str]
    env: dict[str, str]
    cwd: str
    cpus: list[int]


class Reply(msgspec.Struct, frozen=True, omit_defaults=True):
    pid: int = 0
    refused: str = ""


class Exit(msgspec.Struct, frozen=True):
    returncode: int


def mismatch(own: Mapping[str, str], requested: Mapping[str, str]) -> list[str]:
    """The variables read at load on which `requested` differs from the server's `own`."""
    return sorted(
        k
        for k in own.keys() | requested.keys()
        if (k.startswith(LOAD_TIME_PREFIXES) or k in LOAD_TIME_NAMES)
        and own.get(k) != requested.get(k)
    )


# --- the server -----------------------------------------------------------------------------


class _Server:
    """The fork server's loop: accept a request, fork, report the child's exit."""

    def __init__(self, path: str, owner: int) -> None:
        for module in PRELOAD:
            importlib.import_module(module)
        self.env = dict(os.environ)
        # A Python thread would leave its locks held in every child. Native pools that install
        # fork handlers are safe (OpenBLAS, loaded with numpy, parks its workers around fork).
        threads = threading.active_count()
        self.refuse_all = f"the fork server runs {threads} Python threads" if threads != 1 else ""
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.owner = os.pidfd_open(owner)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.owner, selectors.EVENT_READ)
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)

    def run(self) -> None:
        """Serve until the owner exits."""
        print("ready", flush=True)
        while True:
            for key, _ in self.selector.select():
                if key.fd == self.owner:
                    self._leave()
                    return
                if key.fd == self.listener.fileno():
                    conn, _ = self.listener.accept()
                    with conn:
                        try:
                            started = self._start(conn)
                        except Exception:  # one broken request must not end the server
                            log.exception("the fork server dropped a request")
                            continue
                        if started is not None:
                            pid, pidfd = started
                            self.children[pidfd] = (pid, conn.dup())
                            self.selector.register(pidfd, selectors.EVENT_READ)
                else:
                    self._reap(key.fd)

    def _leave(self) -> None:
        path = Path(self.listener.getsockname())
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with conn:
            try:
                conn.sendall(_frame(_encode(Exit(os.waitstatus_to_exitcode(status)))))
            except OSError:
                pass  # the requester is gone

    def _start(self, conn: socket.socket) -> tuple[int, int] | None:
        """Read one request and fork its child: (pid, pidfd), or None if refused or broken."""
        conn.settimeout(10)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] != os.getuid():
            return None
        try:
            head, fds, _, _ = socket.recv_fds(conn, _LEN.size, 3)
        except OSError:
            return None
        try:
            if len(head) != _LEN.size or len(fds) != 3:
                return None
            (size,) = _LEN.unpack(head)
            if size > MAX_REQUEST:
                return None
            body = _recv_exactly(conn, size)
            request = msgspec.msgpack.decode(body, type=Request)
            refused = self.refuse_all or ", ".join(mismatch(self.env, request.env))
            if refused:
                conn.sendall(_frame(_encode(Reply(refused=refused))))
                return None
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child leaves through os._exit
                self._child(request, fds, conn)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        finally:
            for fd in fds:
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        try:
            conn.sendall(_frame(_encode(Reply(pid=pid))))
            # reaped only once the requester holds a pidfd of its own: no signal to a reused pid
            _recv_exactly(conn, 1)
        except OSError:
            pass  # the requester is gone; the child notices and leaves, and is reaped then
        conn.settimeout(None)
        return pid, pidfd

    def _child(self, request: Request, fds: list[int], conn: socket.socket) -> None:
        code = 1
        try:
            self.selector.close()
            self.listener.close()
            os.close(self.owner)
            conn.close()
            for pidfd, (_, other) in self.children.items():
                os.close(pidfd)
                other.close()
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.chdir(request.cwd)
            os.environ.clear()
            os.environ.update(request.env)
            if request.cpus:
                os.sched_setaffinity(0, request.cpus)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            # `random` seeds itself anew in a forked child; numpy's global generator does not
            sys.modules["numpy"].random.seed()
            sys.argv = [sys.executable, "-m", "triode.actors", *request.argv]
            # loaded by PRELOAD; imported here, not above: triode.actors imports this module
            from triode.actors.child import main

            code = main(request.argv, forked=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            try:  # what an interpreter that exits runs: atexit handlers (logging's flush)
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)


def _encode(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)


def _frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


_SERVER_MAIN = "import sys; from triode.actors.forkserver import main; sys.exit(main(sys.argv[1:]))"


def main(argv: Sequence[str]) -> int:
    """`python -c _SERVER_MAIN PATH OWNER_PID`: the fork server's process."""
    path, owner = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner stops us
    _Server(path, int(owner)).run()
    return 0


# --- the owner ------------------------------------------------------------------------------


class Forkserver:
    """A running fork server, as the process that started it sees it.

    `start()` blocks until the server has imported `PRELOAD` and listens; `close()` stops it.
    The server also leaves when its owner exits. Children it forked outlive it: each watches its
    own requester."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="triode-forkserver-")
        os.chmod(self._dir, 0o700)
        self.path = str(Path(self._dir) / "socket")
        self.env = dict(os.environ if env is None else env)
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> Forkserver:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _SERVER_MAIN, self.path, str(os.getpid())],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        self._process.stdout.close()
        if line.strip() != b"ready":
            self.close()
            code = self._process.returncode
            raise RuntimeError(f"the fork server did not start (exit code {code})")
        return self

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        Path(self.path).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            Path(self._dir).rmdir()


# --- the requester --------------------------------------------------------------------------


class ForkedProcess:
    """A child forked by a fork server, with the part of `trio.Process` that `open_child` uses:
    `pid`, `returncode`, `wait()` and `send_signal()`."""

    def __init__(self, pid: int, pidfd: int, conn: trio.socket.SocketType) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._conn = conn
        self._reader: trio.lowlevel.Task | None = None
        self._exited = trio.Event()

    async def wait(self) -> int:
        """Wait for the child to exit and return its exit code (negative: the signal that ended
        it); any number of tasks may wait. A checkpoint; cancelling a wait leaves the child."""
        if self._reader is None:
            self._reader = trio.lowlevel.current_task()
            try:
                body = await _trio_recv_frame(self._conn)
            except BaseException:
                self._reader = None
                raise
            if body:
                self.returncode = msgspec.msgpack.decode(body, type=Exit).returncode
            else:  # the server is gone: the child was reparented and its status is lost
                await trio.lowlevel.wait_readable(self._pidfd)
                self.returncode = -signal.SIGKILL
            self._close()
            self._exited.set()
        else:
            await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, sig)

    def _close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        self._conn.close()

    def __del__(self) -> None:
        if getattr(self, "_pidfd", -1) >= 0:
            os.close(self._pidfd)


async def fork_child(
    path: str, argv: Sequence[str], env: Mapping[str, str]
) -> ForkedProcess | None:
    """Ask the fork server at `path` for a child running `triode.actors.child.main(argv)`.

    Returns None, having logged why, where the server cannot be reached or refuses (a different
    environment): the caller then executes the child itself."""
    conn = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pidfd: int | None = None
    try:
        await conn.connect(path)
        request = Request(list(argv), dict(env), os.getcwd(), sorted(os.sched_getaffinity(0)))
        body = msgspec.msgpack.encode(request)
        # what an executed child inherits: /dev/null in, this process's output and error out
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            await conn.sendmsg(
                [_LEN.pack(len(body))],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [devnull, 1, 2]))],
            )
        finally:
            os.close(devnull)
        await _trio_sendall(conn, body)
        body = await _trio_recv_frame(conn)
        if not body:
            raise OSError("the fork server closed the connection")
        reply = msgspec.msgpack.decode(body, type=Reply)
        if reply.refused:
            log.debug("the fork server refused: %s differ", reply.refused)
            conn.close()
            return None
        pidfd = os.pidfd_open(reply.pid)
        await _trio_sendall(conn, b"\1")
        return ForkedProcess(reply.pid, pidfd, conn)
    except (OSError, msgspec.DecodeError, ValueError) as e:
        log.debug("no child from the fork server at %s: %s", path, e)
        conn.close()
        return None
    except BaseException:  # cancelled (a server stopping while an actor starts): no child
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
        conn.close()
        raise


async def _trio_sendall(conn: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await conn.send(view)
        view = view[sent:]


async def _trio_recv_frame(conn: trio.socket.SocketType) -> bytes:
    """One length-prefixed frame's body; b"" when the connection closed first, or the frame
    would be over `MAX_REQUEST`."""
    head = await _trio_recv_exactly(conn, _LEN.size)
    if not head or (size := _LEN.unpack(head)[0]) > MAX_REQUEST:
        return b""
    return await _trio_recv_exactly(conn, size)


async def _trio_recv_exactly(conn: trio.socket.SocketType, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await conn.recv(size - len(data))
        if not chunk:
            return b""
        data += chunk
    return bytes(data)
