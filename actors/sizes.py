"""Sizes as people write them on a command line: "512MiB", "2G", "1.5GB"."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like "512MiB", "2G", "1.5GB" (binary units)."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", value.lower())
    if match is None:
        raise ValueError(f"not a size: {value!r} (try 512MiB or 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
