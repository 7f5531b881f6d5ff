"""What the HTTP fuzzer sends on one connection: a `Plan` holds the bytes and how they go out
(trickled, cut short, hung up on), and a `Req` per pipelined request holds what the invariants
need of it, whether it carries the server's key among them. A plan's `how` names a crash file so
that `Plan.replaying` sends its bytes the same way again."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Whether a request carries the server's key: VALID (exactly `Bearer KEY`), INVALID (no key, or
# one that must be refused), UNSURE (spellings a server may reasonably take either way).
VALID, INVALID, UNSURE = "valid", "invalid", "unsure"


@dataclass
class Req:
    """One request of a plan, as the invariants need it."""

    method: bytes
    target: bytes
    auth: str = VALID
    # a transfer coding the server need not know: RFC 9112 answers it with 501
    unknown_coding: bool = False


@dataclass
class Plan:
    """Bytes to send on one connection, and how."""

    kind: str
    requests: list[Req]  # pipelined, answered in this order
    data: bytes
    filler: int = 0  # body bytes sent after `data` (made at send time)
    chunked: bool = False  # the filler goes as chunks, ended by a last chunk
    pieces: int = 1  # `data` trickles out in this many pieces...
    delay: float = 0.0  # ...this many seconds apart
    truncate: int | None = None  # send this many bytes of `data`, then half-close
    read_limit: int | None = None  # hang up after this many bytes of answer
    linger: float | None = None  # send, wait this long, hang up without reading
    expect_answer: bool = True  # a complete request: no answer in time is a violation

    def how(self) -> str:
        """How the bytes go out, as a file name suffix that `replaying` reads back."""
        parts = ["eof"] if self.truncate is not None else []
        if self.pieces > 1:
            parts.append(f"slow{self.pieces}x{round(self.delay * 1000)}ms")
        if self.read_limit is not None:
            parts.append(f"drop{self.read_limit}")
        if self.linger is not None:
            parts.append(f"linger{round(self.linger * 1000)}ms")
        return "".join(f"-{part}" for part in parts)

    @classmethod
    def replaying(cls, data: bytes, name: str) -> Plan:
        """A plan that sends `raw()` bytes saved under `name` the way they first went out."""
        method, _, rest = data.partition(b" ")
        plan = cls("replay", [Req(method, rest.partition(b" ")[0])], data)
        if "-eof" in name:
            plan.truncate = len(data)
        if slow := re.search(r"-slow(\d+)x(\d+)ms", name):
            plan.pieces, plan.delay = int(slow[1]), int(slow[2]) / 1000
        if drop := re.search(r"-drop(\d+)", name):
            plan.read_limit = int(drop[1])
        if linger := re.search(r"-linger(\d+)ms", name):
            plan.linger = int(linger[1]) / 1000
        plan.expect_answer = plan.truncate is None and plan.linger is None
        return plan

    def raw(self) -> bytes:
        """Everything this plan sends, in one piece (what a reproducer holds)."""
        data = self.data if self.truncate is None else self.data[: self.truncate]
        if not self.filler:
            return data
        if not self.chunked:
            return data + b"x" * self.filler
        return data + b"%x\r\n%s\r\n0\r\n\r\n" % (self.filler, b"x" * self.filler)
