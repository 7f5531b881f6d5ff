"""What `/init_weight_transfer_engine` and `/update_weights` carry: hostile bodies are refused
with a message that says where, within bounded time, and `unlink_buckets` removes only the
segments an update names, however often it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shm_segments import no_segment_outlives_a_test, segments  # noqa: F401

from triode.wire import OperationError
from triode.wire.tensor_ipc import NAME_PREFIX, share
from triode.wire.weight_update import (
    ALIGN,
    MAX_BUCKETS,
    MAX_NAME,
    MAX_SEGMENT_BYTES,
    MAX_TENSORS,
    BroadcastInit,
    BroadcastUpdate,
    ShmInit,
    ShmUpdate,
    decode_init_info,
    decode_update_info,
    unlink_buckets,
)

SHM = Path("/dev/shm")
SEGMENT = NAME_PREFIX + "0" * 32


def _tensor(name: str = "model.w", offset: int = 0, **fields: Any) -> dict[str, Any]:
    return {"name": name, "dtype": "float32", "shape": [4, 2], "offset": offset, **fields}


def _shm(*tensors: dict[str, Any], nbytes: int = 1024, name: str = SEGMENT) -> dict[str, Any]:
    return {"buckets": [{"shm_name": name, "nbytes": nbytes, "tensors": list(tensors)}]}


def _refused(obj: Any, backend: str = "shm") -> str:
    with pytest.raises(OperationError) as caught:
        decode_update_info(obj, backend)  # type: ignore[arg-type]
    assert caught.value.kind == "invalid"
    return caught.value.message


def test_a_well_formed_shm_update_decodes() -> None:
    update = decode_update_info(
        _shm(_tensor("a.weight"), _tensor("b.bias", offset=ALIGN, dtype="bfloat16", shape=[3])),
        "shm",
    )
    assert isinstance(update, ShmUpdate)
    [bucket] = update.buckets
    assert [(t.name, t.nbytes) for t in bucket.tensors] == [("a.weight", 32), ("b.bias", 6)]


@pytest.mark.parametrize(
    "name",
    ["", "a b", "a.weight\n", "layer/../x", "ünïcode", "a" * (MAX_NAME + 1), "a;b", 7],
)
def test_a_bad_tensor_name_is_refused_with_its_path(name: object) -> None:
    message = _refused(_shm(_tensor(name)))  # type: ignore[arg-type]
    assert "update_info.buckets[0].tensors[0].name" in message


@pytest.mark.parametrize(
    ("tensor", "nbytes", "says"),
    [
        (_tensor(offset=1024), 1024, "past its 1024-byte segment"),
        (_tensor(offset=1000), 1024, "not 64-aligned"),
        (_tensor(shape=[1 << 20]), 1024, "past its 1024-byte segment"),
        (_tensor(dtype="complex64"), 1024, "unknown dtype"),
        (_tensor(dtype="object"), 1024, "unknown dtype"),
        (_tensor(shape=[1 << 20] * 3), 1024, f"more than {MAX_SEGMENT_BYTES}"),
        (_tensor(shape=[1] * 33), 1024, "length <= 32"),
        (_tensor(shape=[-1]), 1024, ">= 0"),
        (_tensor(offset=-64), 1024, ">= 0"),
        (_tensor(extra=1), 1024, "unknown field `extra`"),
        (_tensor(), 0, ">= 1"),
        (_tensor(), MAX_SEGMENT_BYTES + 1, f"<= {MAX_SEGMENT_BYTES}"),
    ],
)
def test_a_tensor_outside_its_segment_or_of_no_wire_dtype_is_refused(
    tensor: dict[str, Any], nbytes: int, says: str
) -> None:
    assert says in _refused(_shm(tensor, nbytes=nbytes))


def test_overlapping_tensors_are_refused() -> None:
    message = _refused(_shm(_tensor("a"), _tensor("b", offset=0, shape=[1])))
    assert "overlaps" in message


def test_empty_tensors_may_sit_anywhere_in_the_segment() -> None:
    update = decode_update_info(_shm(_tensor("a"), _tensor("b", shape=[0, 5]), nbytes=32), "shm")
    assert isinstance(update, ShmUpdate)


@pytest.mark.parametrize(
    "name", ["../../dev/mem", "triode_tensor_" + "Z" * 32, "psm_1234", NAME_PREFIX + "0" * 31]
)
def test_only_names_of_shared_tensors_may_be_opened(name: str) -> None:
    assert "is not a shared tensor's name" in _refused(_shm(_tensor(), name=name))


def test_a_name_twice_in_one_update_is_refused_across_buckets() -> None:
    other = NAME_PREFIX + "1" * 32
    body = _shm(_tensor("a"))
    body["buckets"] += _shm(_tensor("a"), name=other)["buckets"]
    assert "'a' is listed twice" in _refused(body)
    body["buckets"][1]["shm_name"] = SEGMENT
    body["buckets"][1]["tensors"][0]["name"] = "b"
    assert "a segment is listed twice" in _refused(body)


def test_the_counts_are_bounded() -> None:
    """The largest list the decoder takes (MAX_TENSORS tensors) decodes, and one past any
    bound is refused: nothing is allocated for what it announces."""
    many = [_tensor(f"t{i}", offset=i * ALIGN, shape=[1]) for i in range(MAX_TENSORS)]
    update = decode_update_info(_shm(*many, nbytes=MAX_TENSORS * ALIGN), "shm")
    assert isinstance(update, ShmUpdate) and len(update.buckets[0].tensors) == MAX_TENSORS
    many.append(_tensor("one-more", offset=MAX_TENSORS * ALIGN, shape=[1]))
    assert f"length <= {MAX_TENSORS}" in _refused(_shm(*many, nbytes=(MAX_TENSORS + 1) * ALIGN))
    buckets = [
        {"shm_name": NAME_PREFIX + f"{i:032x}", "nbytes": 1, "tensors": []}
        for i in range(MAX_BUCKETS + 1)
    ]
    assert f"length <= {MAX_BUCKETS}" in _refused({"buckets": buckets})
    empty = [_tensor(f"e{i}", shape=[0]) for i in range(MAX_TENSORS)]
    two = _shm(*empty)
    two["buckets"] += _shm(_tensor("e-last", shape=[0]), name=NAME_PREFIX + "1" * 32)["buckets"]
    assert f"{MAX_TENSORS + 1} tensors in one update, more than {MAX_TENSORS}" in _refused(two)


def test_a_body_of_the_wrong_shape_is_refused() -> None:
    assert "update_info: Expected `object`, got `array`" in _refused([1, 2])
    assert "Expected `array`, got `str` - at `update_info.buckets`" in _refused({"buckets": "x"})
    assert "unknown field `handle`" in _refused({"buckets": [], "handle": 1})


def test_a_broadcast_update_decodes_in_vllm_spelling() -> None:
    update = decode_update_info(
        {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], []]},
        "broadcast",
    )
    assert update == BroadcastUpdate(["a", "b"], ["bfloat16", "float32"], [(2, 3), ()])


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"names": ["a"], "dtype_names": [], "shapes": [[1]]}, "differ in length: 1, 0, 1"),
        ({"names": ["a"], "dtype_names": ["float8"], "shapes": [[1]]}, "unknown dtype"),
        ({"names": ["a", "a"], "dtype_names": ["int8"] * 2, "shapes": [[1]] * 2}, "twice"),
        ({"names": ["a"], "dtype_names": ["int8"], "shapes": [[1 << 17] * 3]}, "more than"),
        ({"names": ["a b"], "dtype_names": ["int8"], "shapes": [[1]]}, "update_info.names[0]"),
        (
            {"names": [], "dtype_names": [], "shapes": [], "packed": True},
            "packed broadcasts are not supported",
        ),
    ],
)
def test_a_bad_broadcast_update_is_refused(body: dict[str, Any], says: str) -> None:
    assert says in _refused(body, "broadcast")


def test_init_info_names_its_backend_and_vllms_body_means_the_broadcast() -> None:
    assert decode_init_info({"backend": "shm"}) == ShmInit()
    vllm = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 3, "rank_offset": 1}
    assert decode_init_info(vllm) == BroadcastInit("10.0.0.1", 29500, 3)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"backend": "rdma"}, "Invalid value 'rdma' - at `init_info.backend`"),
        ({"backend": "shm", "x": 1}, "unknown field `x`"),
        ({"master_address": "h", "master_port": 0, "world_size": 2}, "init_info.master_port"),
        ({"master_address": "h", "master_port": 1, "world_size": 1}, "init_info.world_size"),
        ({"master_address": "h\n", "master_port": 1, "world_size": 2}, "master_address"),
        ({"master_address": "h", "master_port": 1, "world_size": 2, "rank_offset": 2}, "<= 1"),
        ({"master_address": "h", "master_port": 1, "world_size": 2, "timeout": 1e9}, "timeout"),
        ({"master_address": "h", "master_port": 1, "world_size": 2, "transport": "mpi"}, "mpi"),
    ],
)
def test_a_bad_init_info_is_refused(body: dict[str, Any], says: str) -> None:
    with pytest.raises(OperationError) as caught:
        decode_init_info(body)
    assert caught.value.kind == "invalid"
    assert says in caught.value.message


def test_unlink_buckets_removes_the_named_segments_once() -> None:
    handles = [share(np.arange(16, dtype=np.float32))[0] for _ in range(2)]
    names = [h.shm_name for h in handles]
    update = decode_update_info(
        {"buckets": [{"shm_name": n, "nbytes": 64, "tensors": []} for n in names]}, "shm"
    )
    assert isinstance(update, ShmUpdate)
    assert set(names) <= segments()
    assert unlink_buckets(update) == 2
    assert not set(names) & segments()
    assert unlink_buckets(update) == 0


def test_unlink_buckets_takes_an_update_that_did_not_decode_and_only_its_segment_names() -> None:
    """The engine core's clean-up runs whatever the body held: a hostile one makes it unlink
    nothing but segments of a shared tensor's name."""
    handle, _ = share(np.zeros(4, dtype=np.int8))
    body = {
        "buckets": [
            {"shm_name": handle.shm_name, "nbytes": -1},  # does not decode, still unlinked
            {"shm_name": "../../psm_other"},
            {"shm_name": 12},
            "not a bucket",
        ]
    }
    assert unlink_buckets(body) == 1
    assert handle.shm_name not in segments()
    for hostile in ({"buckets": "x"}, {"buckets": None}, {}, [1, 2], "text"):
        assert unlink_buckets(hostile) == 0  # type: ignore[arg-type]
