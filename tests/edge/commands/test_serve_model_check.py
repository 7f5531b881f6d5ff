"""`triode serve` on a model that cannot run: one line on stderr and exit status 2, from the
files before any process starts where they tell (an architecture, a tensor's shape, a path), and
from the engine core's failed start where only loading tells (a tensor with no parameter)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from triode.gpu.loader import tiny_random
from triode.wire.ports import free_port


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    """`triode serve ARGS` to its end (a model that served would be a timeout here)."""
    command = [sys.executable, "-m", "triode.edge.cli", "serve", *args, "--log-level", "warning"]
    # the engine core's log level is the server's unless the environment says otherwise
    env = {k: v for k, v in os.environ.items() if k != "TRIODE_LOG_LEVEL"}
    return subprocess.run(
        [*command, "--port", str(free_port())], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_random()


def _copy_with(tiny: Path, into: Path, change: str, tensor: torch.Tensor) -> Path:
    """`tiny` copied to `into`, its tensor `change` replaced by (or added as) `tensor`."""
    shutil.copytree(tiny, into)
    weights = load_file(into / "model.safetensors")
    weights[change] = tensor
    save_file(weights, into / "model.safetensors", metadata={"format": "pt"})
    return into


def test_an_unsupported_architecture_is_one_line_before_the_engine_starts(
    tmp_path: Path, tiny: Path
) -> None:
    shutil.copytree(tiny, tmp_path / "gpt2")
    config = json.loads((tiny / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(config))
    done = _serve(str(tmp_path / "gpt2"))
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith(f"triode serve: {tmp_path / 'gpt2'}: unsupported architecture ")
    assert "GPT2LMHeadModel; supported: " in line and done.stdout == ""


def test_a_tensor_of_the_wrong_shape_is_one_line_naming_it(tmp_path: Path, tiny: Path) -> None:
    name = "model.layers.1.mlp.down_proj.weight"
    shape = load_file(tiny / "model.safetensors")[name].shape
    path = _copy_with(tiny, tmp_path / "m", name, torch.zeros(shape[0], shape[1] + 1))
    done = _serve(str(path))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"triode serve: {path}: tensor {name} has shape [{shape[0]}, {shape[1] + 1}], "
        f"config.json makes it [{shape[0]}, {shape[1]}]"
    ]


def test_a_missing_path_is_one_line(tmp_path: Path) -> None:
    done = _serve(str(tmp_path / "nowhere"))
    assert done.returncode == 2
    assert done.stderr == f"triode serve: {tmp_path / 'nowhere'}: no such file or directory\n"


def test_a_failure_only_loading_finds_is_the_engine_cores_one_line(
    tmp_path: Path, tiny: Path
) -> None:
    name = "model.layers.0.self_attn.extra.weight"  # passes the file check: no shape known
    path = _copy_with(tiny, tmp_path / "m", name, torch.zeros(4))
    done = _serve(str(path))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "triode serve: engine core failed to start: CheckpointMismatch: checkpoint tensor "
        f"{name!r} matches no model parameter"
    ]
