"""A deployment secret for tests that start KV-connector instances (they refuse to start
without one)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def secret_file(directory: Path) -> str:
    """A fresh secret in `directory`/kv.secret, private to the user, as the README makes one;
    its path."""
    path = directory / "kv.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32) + "\n")
    return str(path)
