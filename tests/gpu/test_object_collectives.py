"""Typed values between ranks as msgpack bytes (no pickle): real gloo ranks, and the tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from triode.gpu.local_group import Rank, RankError, run_ranks
from triode.wire import KVConnectorOutput

ROOT = Path(__file__).resolve().parents[2]
# torch.distributed's calls that pickle what they carry
PICKLING = re.compile(
    r"\b(all_gather_object|broadcast_object_list|gather_object|scatter_object_list"
    r"|send_object_list|recv_object_list)\("
)


def _share(me: Rank) -> tuple[list[object], list[int], tuple[str | None, str | None]]:
    from triode.gpu import object_collectives

    report = KVConnectorOutput(finished_sending=[f"r{me.rank}"], bytes_received=me.rank << 40)
    reports = object_collectives.all_gather(report, KVConnectorOutput)
    endpoints = object_collectives.all_gather(None if me.rank else "tcp://x:1", str | None)
    sent = [7, 8, me.rank] if me.rank == 1 else None
    tokens = object_collectives.broadcast(sent, list[int], src=1)
    created = ("seg", None) if me.rank == 0 else None
    pair = object_collectives.broadcast(created, tuple[str | None, str | None], src=0)
    return [*reports, *endpoints], tokens, pair


def _lie_about_the_type(me: Rank) -> None:
    from triode.gpu import object_collectives

    value: object = "not a list of ints" if me.rank == 0 else None
    object_collectives.broadcast(value, list[int], src=0)


@pytest.mark.slow
def test_values_cross_ranks_typed_and_in_rank_order() -> None:
    results = run_ranks(_share, backend="gloo", world=2, timeout=60)
    for gathered, tokens, pair in results:
        assert gathered == [
            KVConnectorOutput(finished_sending=["r0"]),
            KVConnectorOutput(finished_sending=["r1"], bytes_received=1 << 40),
            "tcp://x:1",
            None,
        ]
        assert tokens == [7, 8, 1]
        assert pair == ("seg", None)


@pytest.mark.slow
def test_a_value_of_another_type_is_a_protocol_error_on_the_receiver() -> None:
    with pytest.raises(RankError) as caught:
        run_ranks(_lie_about_the_type, backend="gloo", world=2, timeout=60)
    # each rank decodes what it received, the sender included: both refuse it
    assert all("ProtocolError" in text for text in caught.value.tracebacks.values())
    assert "Expected `array`, got `str`" in caught.value.tracebacks[1]


def test_a_claimed_length_past_the_cap_is_refused_before_allocating() -> None:
    from triode.gpu.object_collectives import MAX_OBJECT_BYTES, _checked_length
    from triode.wire import ProtocolError

    assert _checked_length(MAX_OBJECT_BYTES, 0) == MAX_OBJECT_BYTES
    for length in (MAX_OBJECT_BYTES + 1, -1, 1 << 62):
        with pytest.raises(ProtocolError):
            _checked_length(length, 3)


def test_no_pickling_collective_is_called_in_the_product() -> None:
    """The collectives benchmark measures broadcast_object_list as the alternative it beats: the
    one call site allowed."""
    found = []
    for package in ("actors", "gpu", "wire", "edge"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() == "gpu/bench/collectives.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if PICKLING.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found
