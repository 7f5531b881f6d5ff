"""Tensors through shared memory: round trips, hostile handles, and who unlinks the segment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from shm_segments import no_segment_outlives_a_test, segments  # noqa: F401

from triode.wire import (
    Decoder,
    Encoder,
    EngineCoreRequest,
    ProtocolError,
    SamplingParams,
    TensorHandle,
)
from triode.wire.tensor_ipc import NAME_PREFIX, open_shared, share

SHM = Path("/dev/shm")


def _through_the_wire(handle: TensorHandle) -> TensorHandle:
    request = EngineCoreRequest("r", [0], SamplingParams(), prompt_embeds=handle)
    decoded = Decoder(EngineCoreRequest).decode(Encoder().encode(request))
    assert decoded.prompt_embeds is not None
    return decoded.prompt_embeds


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "bool"])
def test_an_array_round_trips_and_the_receiver_unlinks_it(dtype: str) -> None:
    array = (np.arange(24).reshape(2, 3, 4) % 3).astype(dtype)
    handle, owner = share(array)

    copy = open_shared(_through_the_wire(handle), unlink=True)

    assert handle.shm_name not in segments()
    assert copy.dtype == array.dtype and np.array_equal(copy, array)
    assert copy.flags.writeable and copy.flags.c_contiguous
    owner.unlink()  # idempotent: the receiver was first


def test_bfloat16_travels_as_its_bits_from_torch_or_from_uint16() -> None:
    tensor = torch.randn(3, 5).bfloat16()
    bits = tensor.view(torch.int16).numpy().view(np.uint16)
    for source, dtype in ((tensor, None), (bits, "bfloat16")):
        handle, _owner = share(source, dtype=dtype)
        copy = open_shared(handle, unlink=True)
        assert handle.dtype == "bfloat16" and handle.nbytes == 30
        assert torch.equal(torch.from_numpy(copy.view(np.int16)).view(torch.bfloat16), tensor)


def test_a_non_contiguous_or_big_endian_array_is_shared_in_c_order() -> None:
    array = np.arange(12, dtype=">f4").reshape(3, 4).T
    handle, owner = share(array)
    try:
        assert np.array_equal(open_shared(handle), array)
        assert handle.shm_name in segments()  # the receiver did not unlink: still there
    finally:
        owner.unlink()
    assert handle.shm_name not in segments()


@pytest.mark.parametrize(
    ("tensor", "dtype"),
    [
        (np.zeros((0, 4), np.float32), None),
        (np.array([object()]), None),
        (np.zeros(2, np.float32), "bfloat16"),
        (np.zeros(2, np.complex64), None),
        ([1.0, 2.0], None),
    ],
    ids=["empty", "objects", "float32-as-bfloat16", "complex", "a-list"],
)
def test_what_has_no_wire_dtype_or_no_bytes_is_not_shared(tensor: object, dtype: str) -> None:
    with pytest.raises(ValueError):
        share(tensor, dtype=dtype)


@pytest.mark.parametrize(
    "fields",
    [
        {"shm_name": "psm_cd99894b"},
        {"shm_name": "/" + NAME_PREFIX + "0" * 32},
        {"shm_name": NAME_PREFIX + "0" * 31 + "/"},
        {"shm_name": NAME_PREFIX + "0" * 32 + "\n"},
        {"nbytes": 25},
        {"dtype": "object"},
        {"shape": (1,) * 33, "nbytes": 4},
    ],
    ids=repr,
)
def test_a_handle_that_names_no_tensor_segment_cannot_be_built(fields: dict[str, object]) -> None:
    valid = {"shm_name": NAME_PREFIX + "0" * 32, "dtype": "float32", "shape": (2, 3), "nbytes": 24}
    with pytest.raises(ValueError):
        TensorHandle(**{**valid, **fields})  # type: ignore[arg-type]


def test_a_missing_segment_is_a_protocol_error() -> None:
    handle, owner = share(np.ones(4, np.float32))
    owner.unlink()

    with pytest.raises(ProtocolError, match="does not exist"):
        open_shared(handle, unlink=True)


@pytest.mark.parametrize("shape", [(2,), (8,)], ids=["smaller", "larger"])
def test_a_segment_of_another_size_is_refused_and_still_unlinked(shape: tuple[int]) -> None:
    handle, _owner = share(np.ones(4, np.float32))
    forged = TensorHandle(handle.shm_name, "float32", shape, 4 * shape[0])

    with pytest.raises(ProtocolError, match="holds 16 bytes"):
        open_shared(forged, unlink=True)

    assert handle.shm_name not in segments()


def test_an_empty_segment_is_a_protocol_error() -> None:
    name = NAME_PREFIX + "e" * 32
    (SHM / name).touch(mode=0o600)

    with pytest.raises(ProtocolError, match="cannot be mapped"):
        open_shared(TensorHandle(name, "uint8", (1,), 1), unlink=True)


def _share_in_a_process_that_exits() -> TensorHandle:
    code = (
        "import numpy as np, msgspec; from triode.wire.tensor_ipc import share; "
        "handle, _ = share(np.arange(6, dtype=np.float32)); "
        "print(msgspec.json.encode(handle).decode())"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True
    )
    assert done.stderr == ""  # no resource-tracker warning about a leaked segment
    import msgspec

    return msgspec.json.decode(done.stdout, type=TensorHandle)


def test_a_dead_sender_leaves_the_segment_to_the_receiver_which_unlinks_it() -> None:
    handle = _share_in_a_process_that_exits()
    assert handle.shm_name in segments()  # no resource tracker took it down with its sender

    assert np.array_equal(open_shared(handle, unlink=True), np.arange(6, dtype=np.float32))
    assert handle.shm_name not in segments()


def test_a_sender_that_unlinks_before_any_receiver_leaves_nothing() -> None:
    before = set(os.listdir(SHM))
    _, owner = share(np.ones((3, 3), np.float16))

    owner.unlink()

    assert set(os.listdir(SHM)) == before
