"""HTTP/1.1 over a plain trio TCP stream: bytes go out exactly as a `Plan` holds them (nothing
normalises a path, a header or the framing on the way), and the answers are parsed just enough
to tell their statuses apart, pipelined ones included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from .http_plan import Plan

REQUEST_TIMEOUT = 30.0
_SEND_PIECE = 1 << 20
_KEEP_BODY = 2048  # of each answer, for a violation's message


@dataclass
class Outcome:
    statuses: list[int] = field(default_factory=list)  # final responses, in request order
    bodies: list[bytes] = field(default_factory=list)  # their first bytes
    # "timeout", "reset", "eof" (closed before a complete answer), "dropped" (we hung up)
    error: str = ""


class Responses:
    """An incremental HTTP/1.1 response parser for the answers to pipelined requests."""

    def __init__(self, methods: list[bytes]) -> None:
        self.methods = methods
        self.buffer = bytearray()
        self.statuses: list[int] = []
        self.bodies: list[bytes] = []
        self._mode = "head"  # head | length | size | data | crlf | trailer | eof
        self._remaining = 0

    @property
    def done(self) -> bool:
        return len(self.statuses) >= len(self.methods) and self._mode == "head"

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while self._step():
            pass

    def _step(self) -> bool:
        buf = self.buffer
        if self._mode == "head":
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            lines = bytes(buf[:end]).split(b"\r\n")
            del buf[: end + 4]
            try:
                status = int(lines[0].split(b" ", 2)[1])
            except (IndexError, ValueError):
                status = 0
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200:
                return True  # an interim answer (100 Continue); the real one follows
            method = self.methods[min(len(self.statuses), len(self.methods) - 1)]
            self.statuses.append(status)
            self.bodies.append(b"")
            if method == b"HEAD" or status in (204, 304):
                return True
            if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
                self._mode = "size"
            elif headers.get(b"content-length", b"").isdigit():
                self._remaining = int(headers[b"content-length"])
                self._mode = "length" if self._remaining else "head"
            else:
                self._mode = "eof"
            return True
        if self._mode == "length":
            if self._consume(buf):
                return False
            self._mode = "head"
            return True
        if self._mode == "size":  # a chunk's size line
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            line = bytes(buf[:end]).split(b";")[0].strip()
            del buf[: end + 2]
            try:
                self._remaining = int(line, 16)
            except ValueError:
                self._mode = "eof"
                return True
            self._mode = "data" if self._remaining else "trailer"
            return True
        if self._mode == "data":
            if self._consume(buf):
                return False
            self._mode = "crlf"
            return True
        if self._mode == "crlf":
            if len(buf) < 2:
                return False
            del buf[:2]
            self._mode = "size"
            return True
        if self._mode == "trailer":
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            del buf[: end + 2]
            if end == 0:
                self._mode = "head"
            return True
        self._keep(bytes(buf))  # eof: everything until the connection closes
        buf.clear()
        return False

    def _consume(self, buf: bytearray) -> int:
        """Take up to `_remaining` body bytes off `buf`; returns how many are still to come."""
        take = min(self._remaining, len(buf))
        self._keep(bytes(buf[:take]))
        del buf[:take]
        self._remaining -= take
        return self._remaining

    def _keep(self, data: bytes) -> None:
        room = _KEEP_BODY - len(self.bodies[-1])
        if room > 0:
            self.bodies[-1] += data[:room]


async def exchange(plan: Plan, host: str, port: int, within: float = REQUEST_TIMEOUT) -> Outcome:
    """Send `plan` on a fresh connection and read the answers. Never raises for what the server
    does: a timeout, a reset or an early close is noted in `Outcome.error`."""
    responses = Responses([r.method for r in plan.requests])
    outcome = Outcome()
    budget = within + plan.pieces * plan.delay + (plan.linger or 0)
    try:
        with trio.fail_after(budget):
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                if plan.linger is not None:
                    await _send(stream, plan)
                    await trio.sleep(plan.linger)
                    outcome.error = "dropped"
                else:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_send, stream, plan)
                        outcome.error = await _receive(stream, responses, plan.read_limit)
                        nursery.cancel_scope.cancel()
    except trio.TooSlowError:
        outcome.error = "timeout"
    except (OSError, trio.BrokenResourceError):
        outcome.error = "reset"
    outcome.statuses, outcome.bodies = responses.statuses, responses.bodies
    return outcome


async def _send(stream: trio.SocketStream, plan: Plan) -> None:
    data = plan.data if plan.truncate is None else plan.data[: plan.truncate]
    try:
        if plan.pieces > 1:
            size = max(1, -(-len(data) // plan.pieces))
            for start in range(0, len(data), size):
                await stream.send_all(data[start : start + size])
                await trio.sleep(plan.delay)
        else:
            await stream.send_all(data)
        if plan.filler:
            await _send_filler(stream, plan)
        if plan.truncate is not None:
            await stream.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the server answered early (413) or gave up on us; the reader sees what it sent


async def _send_filler(stream: trio.SocketStream, plan: Plan) -> None:
    left = plan.filler
    piece = b"x" * _SEND_PIECE
    while left > 0:
        chunk = piece[: min(left, _SEND_PIECE)]
        left -= len(chunk)
        if plan.chunked:
            chunk = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        await stream.send_all(chunk)
    if plan.chunked:
        await stream.send_all(b"0\r\n\r\n")


async def _receive(stream: trio.SocketStream, responses: Responses, limit: int | None) -> str:
    received = 0
    while not responses.done:
        try:
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            return "reset"
        if not data:
            return "" if responses.done else "eof"
        received += len(data)
        responses.feed(data)
        if limit is not None and received >= limit:
            return "dropped"
    return ""
