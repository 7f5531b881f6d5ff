"""The JSON-valued engine flags (`--kv-transfer-config`, `--kv-events-config`,
`--speculative-config`): one decoding, so each says its problems the same way."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

_ConfigT = TypeVar("_ConfigT", bound=msgspec.Struct)


def parse_config(
    value: str | dict[str, Any] | _ConfigT,
    kind: type[_ConfigT],
    name: str,
    *,
    max_chars: int | None = None,
) -> _ConfigT:
    """A `kind` from its JSON text (the CLI's, at most `max_chars` long), a dict, or itself;
    ValueError naming the flag (`name`) when invalid."""
    try:
        if isinstance(value, kind):
            return value
        if isinstance(value, str):
            if max_chars is not None and len(value) > max_chars:
                raise ValueError(f"{name}: over {max_chars} characters")
            return msgspec.json.decode(value, type=kind)
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        raise ValueError(f"{name}: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"{name} is not JSON: {e}") from None
