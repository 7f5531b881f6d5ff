"""`prompt_embeds` of `/v1/completions`: base64 of a `torch.save`d tensor, as vLLM takes them.

The payload is untrusted. It must be a zip archive (what `torch.save` writes) whose entries are
stored, not compressed, and add up to no more than the body limit, so nothing inflates past
what the client sent; then `torch.load(..., weights_only=True)` reads it, which unpickles
tensors and plain containers only and refuses any other global, so no payload runs code. What
comes out must be one dense CPU tensor [positions, hidden size] (or [1, positions, hidden size])
of float32, bfloat16 or float16, with finite values and fewer positions than the context,
whose elements are all in the payload: a view that repeats them (a stride of 0, an expanded
tensor) would make a few kilobytes into any size once made contiguous. Anything else is a 400
naming `prompt_embeds`. torch is imported on the first such request.
"""

from __future__ import annotations

import base64
import binascii
import io
import zipfile
from typing import Any

from triode.actors import check_prompt_embeds, describe_prompt_embeds

from ..errors import APIError

PARAM = "prompt_embeds"


def decode_prompt_embeds(
    payload: str, *, hidden_size: int, max_model_len: int, max_bytes: int
) -> Any:
    """The tensor [positions, `hidden_size`] that `payload` holds (`hidden_size` 0: any).
    Blocks for the decode; raises a 400 `APIError` for any payload that is not one."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _invalid("must be base64") from None
    _check_archive(raw, max_bytes)
    # torch loads with the first payload: the edge process runs without it otherwise
    import torch

    try:
        loaded = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:  # the unpickler refused it, or torch could not rebuild it
        raise _invalid(f"not a torch.save'd tensor ({type(e).__name__})") from None
    if not isinstance(loaded, torch.Tensor):
        raise _invalid(f"must be a tensor, not {type(loaded).__name__}")
    if loaded.layout != torch.strided or loaded.is_quantized or loaded.device.type != "cpu":
        raise _invalid("must be a dense tensor")
    if loaded.numel() * loaded.element_size() > loaded.untyped_storage().nbytes():
        raise _invalid(
            "its elements overlap (a stride of 0, or an expanded view): send a tensor that "
            "holds its own values"
        )
    tensor = loaded.detach().as_subclass(torch.Tensor)
    if tensor.ndim == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    try:
        check_prompt_embeds(*describe_prompt_embeds(tensor), hidden_size)
    except ValueError as e:  # the engine's own check, named for the field here
        raise _invalid(str(e).removeprefix(f"{PARAM}: ")) from None
    positions = tensor.shape[0]
    if positions >= max_model_len:
        raise _invalid(
            f"{positions} positions, but this model's maximum context length is "
            f"{max_model_len} tokens and at least one must be generated"
        )
    if not bool(torch.isfinite(tensor).all()):
        raise _invalid("holds values that are not finite")
    return tensor.contiguous()


def _check_archive(raw: bytes, max_bytes: int) -> None:
    """A 400 unless `raw` is a zip archive whose entries are stored and fit in `max_bytes`."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        raise _invalid("not a torch.save'd tensor (not a zip archive)") from None
    if any(e.compress_type != zipfile.ZIP_STORED for e in entries):
        raise _invalid("the archive's entries must be stored, not compressed")
    if sum(e.file_size for e in entries) > max_bytes:
        raise _invalid(f"the archive holds more than {max_bytes} bytes")


def _invalid(why: str) -> APIError:
    return APIError(400, f"{PARAM}: {why}", param=PARAM)
