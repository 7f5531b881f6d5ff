"""msgpack codec with out-of-band array frames.

A message encodes to frames `[msgpack, *aux]`. numpy arrays and torch tensors of at least
`aux_threshold` bytes travel as their own frame, referenced from the msgpack body by index and
sent without a copy; smaller ones are inlined as msgpack bin. Both encode as `[dtype, shape,
data]` where `data` is bin (inline) or an int (aux index). torch is imported only when a tensor
is encoded or a tensor field is decoded.

Decoders are total: any frames decode to a valid message or raise `ProtocolError`. Arrays decoded
from aux frames share the frame's memory and are read-only.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from .errors import ProtocolError

T = TypeVar("T")

DEFAULT_AUX_THRESHOLD = 256
_MAX_DIMS = 32

# Wire dtype name -> numpy dtype (None where numpy has no equivalent).
_DTYPES: dict[str, np.dtype | None] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}
_DTYPES["bfloat16"] = None
_ITEMSIZE = {name: (dt.itemsize if dt is not None else 2) for name, dt in _DTYPES.items()}

Buffer = bytes | bytearray | memoryview


class Encoder:
    """Encodes messages to frames. Reuse one per sending task; it is not thread-safe."""

    def __init__(self, *, aux_threshold: int = DEFAULT_AUX_THRESHOLD) -> None:
        self._threshold = aux_threshold
        self._aux: list[Buffer] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, msg: Any) -> list[Buffer]:
        """Return `[msgpack, *aux]`. Aux frames alias the arrays' memory: do not mutate an
        array until the send that carries it is done."""
        self._aux = aux = []
        try:
            body = self._encoder.encode(msg)
        finally:
            self._aux = []
        return [body, *aux]

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._encode_ndarray(obj)
        if isinstance(obj, np.generic):
            return obj.item()
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_tensor(torch, obj)
        raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")

    def _encode_ndarray(self, arr: np.ndarray) -> list[Any]:
        name = arr.dtype.name
        if _DTYPES.get(name, None) is None or arr.dtype.hasobject:
            raise NotImplementedError(f"cannot encode arrays of dtype {arr.dtype}")
        if arr.dtype.byteorder == ">" or not arr.flags.c_contiguous:
            arr = arr.astype(arr.dtype.newbyteorder("<"), order="C")
        return [name, list(arr.shape), self._data(memoryview(arr.reshape(-1).view(np.uint8)))]

    def _encode_tensor(self, torch: Any, t: Any) -> list[Any]:
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise NotImplementedError(f"cannot encode tensors of dtype {t.dtype}")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        return [name, list(t.shape), self._data(memoryview(raw))]

    def _data(self, raw: memoryview) -> Buffer | int:
        if raw.nbytes < self._threshold:
            return raw
        self._aux.append(raw)
        return len(self._aux) - 1


class Decoder(Generic[T]):
    """Decodes frames `[msgpack, *aux]` into `type`. Reuse one per receiving task."""

    def __init__(self, type: type[T]) -> None:
        self._type = type
        self._aux: Sequence[Any] = ()
        self._used: set[int] = set()
        self._decoder = msgspec.msgpack.Decoder(type, dec_hook=self._dec_hook)

    def decode(self, frames: Sequence[Any]) -> T:
        """Decode one message; raise `ProtocolError` for anything that is not one."""
        if not frames:
            raise ProtocolError("empty message")
        self._aux = frames[1:]
        self._used = set()
        try:
            msg = self._decoder.decode(frames[0])
            if len(self._used) != len(self._aux):
                raise ProtocolError(
                    f"{len(self._aux) - len(self._used)} aux frame(s) not referenced by the message"
                )
            return msg
        except ProtocolError:
            raise
        except msgspec.ValidationError as e:
            raise ProtocolError(f"invalid {_type_name(self._type)}: {e}") from None
        except Exception as e:  # totality: nothing but ProtocolError leaves a decoder
            raise ProtocolError(f"undecodable {_type_name(self._type)}: {e!r}") from None
        finally:
            self._aux = ()

    def _dec_hook(self, type: Any, obj: Any) -> Any:
        if type is np.ndarray:
            name, shape, raw = self._array_parts(obj)
            dtype = _DTYPES[name]
            if dtype is None:
                raise ValueError(f"dtype {name} has no numpy equivalent")
            return np.frombuffer(raw, dtype=dtype).reshape(shape)
        if getattr(type, "__module__", "").startswith("torch") and type.__name__ == "Tensor":
            return self._tensor(*self._array_parts(obj))
        raise ValueError(f"unsupported type {type!r}")

    def _array_parts(self, obj: Any) -> tuple[str, tuple[int, ...], Buffer]:
        if not (isinstance(obj, list) and len(obj) == 3):
            raise ValueError("array must be [dtype, shape, data]")
        name, shape, data = obj
        if not (isinstance(name, str) and name in _DTYPES):
            raise ValueError(f"unknown dtype {name!r}")
        if not (
            isinstance(shape, list)
            and len(shape) <= _MAX_DIMS
            and all(type(d) is int and d >= 0 for d in shape)
        ):
            raise ValueError("shape must be a list of non-negative ints")
        if type(data) is int:
            if not 0 <= data < len(self._aux) or data in self._used:
                raise ValueError(f"bad aux frame index {data}")
            self._used.add(data)
            raw = memoryview(self._aux[data]).cast("B").toreadonly()
        elif isinstance(data, bytes):
            raw = memoryview(data)
        else:
            raise ValueError("array data must be bin or an aux frame index")
        expected = math.prod(shape) * _ITEMSIZE[name]
        if raw.nbytes != expected:
            raise ValueError(f"array of {shape} {name} needs {expected} bytes, got {raw.nbytes}")
        return name, tuple(shape), raw

    @staticmethod
    def _tensor(name: str, shape: tuple[int, ...], raw: memoryview) -> Any:
        import torch  # only where a tensor arrives: triode.wire imports without torch

        dtype = getattr(torch, name)
        if raw.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            # Received frames are immutable; the tensor shares them and must be treated
            # as read-only, which is what torch warns about.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or repr(t)
