"""What `add_lora` refuses, naming the problem and changing nothing, and the runner's refusals
of steps that name adapters it does not hold."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_builders import build_adapter, prompt, runner
from runner_driver import GREEDY
from safetensors.torch import load_file, save_file

from triode.gpu.lora import adapter_digest
from triode.gpu.model_runner import ModelRunner
from triode.gpu.operations import Operations
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import NewRequestData, OperationError, ScheduledRequest, SchedulerOutput

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-refusals")


@pytest.fixture(scope="module")
def tiny(root: Path) -> Path:
    return build_tiny_model(root / "tiny")


@pytest.fixture(scope="module")
def good(root: Path, tiny: Path) -> Path:
    return build_adapter(tiny, root / "good", seed=0, **LORA)


@pytest.fixture(scope="module")
def ops(tiny: Path) -> Operations:
    return Operations(runner(tiny, {"max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 8}))


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "adapter"))


def _edit_config(path: Path, **changes: Any) -> Path:
    config_file = path / "adapter_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | changes))
    return path


def _refused(ops: Operations, path: Path | str, kind: str = "invalid", **kwargs: Any) -> str:
    before = ops.runner.lora.adapters.copy()  # type: ignore[union-attr]
    with pytest.raises(OperationError) as e:
        ops.add_lora(7, str(path), **kwargs)
    assert e.value.kind == kind
    assert ops.runner.lora.adapters == before  # type: ignore[union-attr]
    return str(e.value)


def test_a_rank_over_max_lora_rank_is_refused(ops: Operations, root: Path, tiny: Path) -> None:
    path = build_adapter(tiny, root / "r16", seed=1, r=16, target_modules=["q_proj"])
    assert "rank 16, over --max-lora-rank 8" in _refused(ops, path)


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_targets_other_than_the_seven_projections_are_refused_by_name(
    ops: Operations, root: Path, tiny: Path, target: str
) -> None:
    with warnings.catch_warnings():  # peft's, on adapting a layer tied to another
        warnings.simplefilter("ignore")
        path = build_adapter(tiny, root / target, seed=2, r=4, target_modules=["q_proj", target])
    assert repr(target) in _refused(ops, path)
    # the tensors are checked too, whatever the config says
    _edit_config(path, target_modules=["q_proj"])
    assert target in _refused(ops, path)


def test_a_regex_target_matching_a_norm_is_refused(
    ops: Operations, good: Path, tmp_path: Path
) -> None:
    path = _edit_config(_copy(good, tmp_path), target_modules=r".*(q_proj|input_layernorm)")
    assert "'model.layers.0.input_layernorm' is not supported" in _refused(ops, path)


def test_missing_files_are_refused(ops: Operations, good: Path, tmp_path: Path) -> None:
    assert "is not a directory" in _refused(ops, tmp_path / "nowhere")
    path = _copy(good, tmp_path)
    (path / "adapter_model.safetensors").unlink()
    assert "has no adapter_model.safetensors" in _refused(ops, path)
    shutil.copy(good / "adapter_model.safetensors", path)
    (path / "adapter_config.json").unlink()
    assert "has no adapter_config.json" in _refused(ops, path)


def test_files_larger_than_any_adapter_of_the_model_are_refused_unread(
    ops: Operations, good: Path, tmp_path: Path
) -> None:
    """What one load may cost is bounded by the model and --max-lora-rank, not by the files:
    a larger one (sparse here: no disk or memory spent) is refused before it is read."""
    path = _copy(good, tmp_path)
    with (path / "adapter_model.safetensors").open("r+b") as f:
        f.truncate(1 << 40)
    assert "more than any LoRA adapter of this model" in _refused(ops, path)
    shutil.copy(good / "adapter_model.safetensors", path)
    with (path / "adapter_config.json").open("r+b") as f:
        f.truncate(1 << 30)
    assert "adapter_config.json" in _refused(ops, path)


def test_a_pickled_adapter_only_is_refused_asking_for_safetensors(
    ops: Operations, good: Path, tmp_path: Path
) -> None:
    path = _copy(good, tmp_path)
    weights = load_file(path / "adapter_model.safetensors")
    torch.save(weights, path / "adapter_model.bin")
    (path / "adapter_model.safetensors").unlink()
    assert "convert it to safetensors" in _refused(ops, path)


def test_an_adapter_of_another_model_size_is_refused_naming_the_tensor(
    ops: Operations, root: Path
) -> None:
    other = build_tiny_model(root / "wider", hidden_size=96, num_heads=6, num_kv_heads=3)
    path = build_adapter(other, root / "wider-adapter", seed=3, **LORA)
    message = _refused(ops, path)
    assert re.search(r"lora_A.weight has shape \[8, 96\], this model needs \[8, 64\]", message) or (
        re.search(r"lora_B.weight has shape \[96, 8\], this model needs \[64, 8\]", message)
    )


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "bias 'lora_only'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ],
)
def test_config_options_beyond_plain_lora_are_refused(
    ops: Operations, good: Path, tmp_path: Path, change: dict, named: str
) -> None:
    assert named in _refused(ops, _edit_config(_copy(good, tmp_path), **change))


def test_a_dora_adapter_made_by_peft_is_refused(ops: Operations, root: Path, tiny: Path) -> None:
    path = build_adapter(tiny, root / "dora", seed=4, r=4, target_modules=["q_proj"], use_dora=True)
    assert "DoRA" in _refused(ops, path)


def test_unknown_tensors_and_integer_tensors_are_refused(
    ops: Operations, good: Path, tmp_path: Path
) -> None:
    path = _copy(good, tmp_path)
    weights = load_file(path / "adapter_model.safetensors")
    save_file(weights | {"extra.weight": torch.zeros(2)}, path / "adapter_model.safetensors")
    assert "unknown tensor 'extra.weight'" in _refused(ops, path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    weights[key] = weights[key].to(torch.int32)
    save_file(weights, path / "adapter_model.safetensors")
    assert "has dtype I32" in _refused(ops, path)


def test_a_digest_that_the_files_no_longer_have_is_refused(
    ops: Operations, good: Path, tmp_path: Path
) -> None:
    path = _copy(good, tmp_path)
    digest = adapter_digest(path)
    _edit_config(path, lora_alpha=3)
    assert adapter_digest(path) != digest
    assert "changed on disk" in _refused(ops, path, digest=digest)
    assert ops.add_lora(7, str(path), digest=adapter_digest(path))["digest"] != digest
    ops.remove_lora([7])


def test_lora_off_refuses_as_unsupported(tiny: Path, good: Path) -> None:
    ops = Operations(runner(tiny, lora_config=None))
    with pytest.raises(OperationError, match="--enable-lora") as e:
        ops.add_lora(1, str(good))
    assert e.value.kind == "unsupported"


def test_more_resident_than_max_cpu_loras_and_a_resident_id_are_conflicts(
    ops: Operations, good: Path
) -> None:
    assert ops.add_lora(1, str(good))["rank"] == 8
    assert "resident already" in _refused_id(ops, 1, good)
    ops.add_lora(2, str(good))
    assert "--max-cpu-loras" in _refused(ops, good, kind="conflict")
    assert ops.remove_lora([1, 2, 99])["resident"] == 0


def _refused_id(ops: Operations, lora_id: int, path: Path) -> str:
    with pytest.raises(OperationError) as e:
        ops.add_lora(lora_id, str(path))
    assert e.value.kind == "conflict"
    return str(e.value)


def _step(r: ModelRunner, step: int, lora_ids: dict[str, int]) -> None:
    requests = [
        ScheduledRequest(
            rid, prompt(5, i), 0, [i], new=NewRequestData(prompt(5, i), GREEDY, lora_id=lora_id)
        )
        for i, (rid, lora_id) in enumerate(lora_ids.items())
    ]
    r.execute(SchedulerOutput(step, requests))


def test_a_step_with_a_removed_adapter_is_a_key_error(tiny: Path, good: Path) -> None:
    r = runner(tiny)
    ops = Operations(r)
    ops.add_lora(3, str(good))
    _step(r, 0, {"a": 3, "b": 0})
    ops.remove_lora([3])
    with pytest.raises(KeyError, match=r"\[3\] are not resident"):
        _step(r, 1, {"c": 3})


def test_more_adapters_in_a_step_than_max_loras_is_a_value_error(tiny: Path, good: Path) -> None:
    r = runner(tiny, {"max_loras": 1, "max_cpu_loras": 2})
    ops = Operations(r)
    ops.add_lora(1, str(good))
    ops.add_lora(2, str(good))
    with pytest.raises(ValueError, match="2 LoRA adapters in one step"):
        _step(r, 0, {"a": 1, "b": 2})


def test_an_adapter_id_where_lora_is_off_is_a_key_error(tiny: Path) -> None:
    with pytest.raises(KeyError, match="LoRA is not enabled"):
        _step(runner(tiny, lora_config=None), 0, {"a": 1})
