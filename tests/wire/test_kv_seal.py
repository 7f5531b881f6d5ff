"""Seals on kv_transfer_params: the secret file, the prompt digest, sealing and checking."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from triode.wire import kv_seal
from triode.wire.kv_seal import (
    SECRET_RECIPE,
    SecretFileError,
    prompt_digest,
    read_secret,
    seal,
    seal_remote_decode,
    verify,
    verify_remote_decode,
)

SECRET = b"0123456789abcdef" * 4
NOW = 1_800_000_000.0
PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e1",
    "remote_request_id": "r1",
    "remote_block_ids": [3, 4, 5],
    "remote_endpoints": ["tcp://127.0.0.1:5000"],
    "remote_num_tokens": 40,
    "tp_size": 1,
    "pp_size": 1,
    "block_size": 16,
    "transport": "tcp",
}


def _secret_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "kv.secret"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_read_secret_takes_a_private_file(tmp_path: Path) -> None:
    path = _secret_file(tmp_path, SECRET + b"\n")
    assert read_secret(path) == SECRET


@pytest.mark.parametrize(
    ("content", "mode", "says"),
    [
        (SECRET, 0o640, "chmod 600"),
        (SECRET, 0o604, "chmod 600"),
        (b"short\n", 0o600, SECRET_RECIPE),
        (b"", 0o600, SECRET_RECIPE),
        (b"x" * (kv_seal.MAX_SECRET_BYTES + 1), 0o600, SECRET_RECIPE),
    ],
)
def test_read_secret_refuses_like_ssh(tmp_path: Path, content: bytes, mode: int, says: str) -> None:
    path = _secret_file(tmp_path, content, mode)
    with pytest.raises(SecretFileError) as e:
        read_secret(path)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_read_secret_refuses_a_missing_file_and_a_directory(tmp_path: Path) -> None:
    with pytest.raises(SecretFileError, match="make one with"):
        read_secret(tmp_path / "absent")
    os.mkfifo(tmp_path / "fifo", 0o600)  # would block a reader that opened it blocking
    for path in (tmp_path, tmp_path / "fifo"):
        with pytest.raises(SecretFileError, match="not a regular file"):
            read_secret(path)


def test_the_recipe_makes_a_file_that_is_taken(tmp_path: Path) -> None:
    import subprocess

    subprocess.run(SECRET_RECIPE.replace("python", "python3"), shell=True, cwd=tmp_path, check=True)
    assert len(read_secret(tmp_path / "kv.secret")) == 64


def test_prompt_digest_covers_tokens_and_salt() -> None:
    base = prompt_digest([1, 2, 3])
    assert base == prompt_digest((1, 2, 3))
    assert base != prompt_digest([1, 2, 4])
    assert base != prompt_digest([1, 2, 3, 0])
    assert base != prompt_digest([1, 2, 3], cache_salt="a")
    assert prompt_digest([1, 2, 3], cache_salt="a") != prompt_digest([1, 2, 3], cache_salt="b")
    assert prompt_digest([1], cache_salt="") != prompt_digest([1])
    with pytest.raises(ValueError):
        prompt_digest([2**40])


def test_sealed_params_verify_for_their_prompt_only() -> None:
    digest = prompt_digest(range(40))
    sealed = seal(SECRET, PARAMS, digest, ttl=120, now=NOW)
    assert verify(SECRET, sealed, digest, now=NOW + 60) is None
    assert "another prompt" in verify(SECRET, sealed, prompt_digest(range(1, 41)), now=NOW)
    assert "expired" in verify(SECRET, sealed, digest, now=NOW + 121)
    assert "future" in verify(SECRET, sealed, digest, now=NOW - 3600)
    assert "does not match" in verify(b"another deployment's secret....", sealed, digest, now=NOW)


@pytest.mark.parametrize(
    "change",
    [
        {"remote_block_ids": [3, 4, 6]},
        {"remote_endpoints": ["tcp://10.0.0.1:5000"]},
        {"remote_request_id": "r2"},
        {"remote_num_tokens": 41},
        {"expires_at": 2**40},
        {"prompt_digest": prompt_digest([1])},
        {"extra": 1},
        {"tp_size": True},
    ],
)
def test_any_change_breaks_the_seal(change: dict) -> None:
    digest = prompt_digest(range(40))
    sealed = seal(SECRET, PARAMS, digest, ttl=120, now=NOW)
    assert verify(SECRET, {**sealed, **change}, digest, now=NOW) is not None


def test_unsealed_odd_and_oversized_params_are_refused_without_raising() -> None:
    digest = prompt_digest([1])
    sealed = seal(SECRET, PARAMS, digest, ttl=120, now=NOW)
    for params in (
        PARAMS,
        *(
            {**sealed, **odd}
            for odd in (
                {"x": 2**64},
                {"x": [2**70]},
                {"x": {"y": 1}},
                {"x": 1.5},
                {"x": "a" * 100_000},
            )
        ),
        {**PARAMS, "seal": 5},
        {**PARAMS, "seal": "ü"},
        {**PARAMS, "remote_num_tokens": 2**64},
        {**PARAMS, "remote_block_ids": [2**70]},
        {**PARAMS, "remote_block_ids": [[1]]},
        {**PARAMS, "x": {"y": 1}},
        {**PARAMS, "x": 1.5},
        {**PARAMS, "x": "a" * (kv_seal.MAX_STRING + 1)},
        {**PARAMS, "remote_block_ids": [0] * (kv_seal.MAX_LIST + 1)},
        {f"k{i}": 1 for i in range(kv_seal.MAX_FIELDS + 1)},
        [1, 2],
        "sealed",
        None,
    ):
        assert verify(SECRET, params, digest, now=NOW) is not None


def test_a_remote_decode_seal_is_not_a_params_seal() -> None:
    request = seal_remote_decode(SECRET, {"do_remote_decode": True}, now=NOW)
    assert verify_remote_decode(SECRET, request, now=NOW + 1) is None
    assert request["nonce"] != seal_remote_decode(SECRET, {}, now=NOW)["nonce"]
    assert verify_remote_decode(SECRET, {"do_remote_decode": True}, now=NOW) is not None
    assert verify_remote_decode(SECRET, request, now=NOW + 3600) is not None
    # the same bytes under the other domain tag do not verify
    params = seal(SECRET, {"do_remote_decode": True}, "d", ttl=120, now=NOW)
    assert verify_remote_decode(SECRET, params, now=NOW) is not None
    assert verify(SECRET, request, "d", now=NOW) is not None
