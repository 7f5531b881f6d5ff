"""A rank's administrative operations on a real model runner: sleep and wake give memory back and
restore the same outputs, new weights (from disk or pushed) give what a fresh runner on them
gives, bad weights change nothing, and a profile holds the forward passes."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_families import write_gguf
from kv_secret import secret_file
from safetensors.torch import load_file, save_file

from triode.gpu import int4, memory, model_runner
from triode.gpu.layers import LinearBase
from triode.gpu.loader import convert_gguf
from triode.gpu.model_files import checkpoint_weights
from triode.gpu.model_runner import ModelRunner
from triode.gpu.operations import Operations
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import (
    NewRequestData,
    OperationError,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=None, logprobs=2)
PROMPTS = [[(7 * i + 3) % 250 + 3 for i in range(21)], [(11 * i + 5) % 250 + 3 for i in range(9)]]
MiB = 1 << 20
_ids = itertools.count()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("operations")


@pytest.fixture(scope="module")
def tiny(root: Path) -> Path:
    return build_tiny_model(root / "tiny")


@pytest.fixture(scope="module")
def large(root: Path) -> Path:
    """About 60 MiB of float32 weights: a release of them stands well out of the RSS noise."""
    return build_tiny_model(
        root / "large", hidden_size=512, intermediate_size=1536, num_layers=5, num_heads=8
    )


def _runner(model_dir: Path, **kwargs: Any) -> ModelRunner:
    options: dict[str, Any] = {
        "dtype": "float32",
        "kv_cache_memory": 4 * MiB,
        "max_model_len": 256,
        "num_threads": 1,
        "device": "cpu",  # what the resident set measures
    }
    return ModelRunner(model_dir, **(options | kwargs))


def _greedy(runner: ModelRunner, new_tokens: int = 6) -> tuple[list[list[int]], np.ndarray]:
    """Both prompts decoded greedily side by side: their tokens, and every step's logprobs."""
    ids = [f"r{next(_ids)}" for _ in PROMPTS]
    tokens = [list(p) for p in PROMPTS]
    computed = [0] * len(PROMPTS)
    per_block = runner.block_size
    first_block = [0, -(-(len(PROMPTS[0]) + new_tokens) // per_block)]
    rows = []
    for step in range(new_tokens):
        scheduled = []
        for i, request_id in enumerate(ids):
            blocks = list(range(first_block[i], first_block[i] + -(-len(tokens[i]) // per_block)))
            new = NewRequestData(PROMPTS[i], GREEDY) if step == 0 else None
            scheduled.append(
                ScheduledRequest(
                    request_id, tokens[i][computed[i] :], computed[i], blocks, sample=True, new=new
                )
            )
        out = runner.execute(SchedulerOutput(step, scheduled))
        for i, result in enumerate(out.results):
            computed[i] = len(tokens[i])
            assert result.token_id is not None and result.logprobs is not None
            tokens[i].append(result.token_id)
            rows.append(result.logprobs.logprobs)
    runner.execute(SchedulerOutput(new_tokens, [], finished_request_ids=ids))
    return [t[len(p) :] for t, p in zip(tokens, PROMPTS, strict=True)], np.concatenate(rows)


def _assert_same(a: tuple[list[list[int]], np.ndarray], b: tuple[list[list[int]], np.ndarray]):
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])


def _settled_rss() -> int:
    """The resident set once earlier tests' garbage (models are reference cycles) is gone and
    given back, so that what a release frees is measured, not what the collector found."""
    memory.release_memory(torch.device("cpu"))
    return memory.rss_bytes()


def _copy_checkpoint(src: Path, dst: Path, change: dict[str, torch.Tensor] | None = None) -> Path:
    """`src` copied to `dst` with its tensors updated from `change` (missing ones added)."""
    shutil.copytree(src, dst)
    if change:
        tensors = load_file(dst / "model.safetensors") | change
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _perturbed(model_dir: Path, names: list[str] | None = None, seed: int = 1) -> dict:
    """New values for tensors `names` of `model_dir` (all by default): each nudged by noise of a
    third of its own spread, enough to change a random model's picks."""
    tensors = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    return {
        name: t + torch.randn(t.shape, generator=g) * t.std() / 3
        for name, t in tensors.items()
        if names is None or name in names
    }


# --- sleep and wake -------------------------------------------------------------------------------


def test_kv_cache_sleep_gives_its_memory_back_and_wakes_zeroed_to_the_same_outputs(
    large: Path,
) -> None:
    runner = _runner(large, kv_cache_memory=64 * MiB)
    ops = Operations(runner)
    before = _greedy(runner)
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert kv_bytes >= 60 * MiB
    rss = _settled_rss()

    slept = ops.sleep(["kv_cache"])
    assert slept["freed_bytes"] == kv_bytes and slept["asleep"] == ["kv_cache"]
    # all of it, less what else the process took meanwhile (a few pages, in a full run)
    assert rss - slept["rss_bytes"] >= 0.95 * kv_bytes
    with pytest.raises(RuntimeError, match="kv_cache sleep"):
        _greedy(runner)

    woke = ops.wake_up(["kv_cache"])
    assert woke["allocated_bytes"] == kv_bytes and woke["asleep"] == []
    assert not runner.kv_cache.any()  # zeros: padded reads see finite values
    attn = runner.model.model.stage_layers[-1].self_attn.attn
    assert attn.k_cache.data_ptr() >= runner.kv_cache.data_ptr()
    _assert_same(_greedy(runner), before)


def test_weights_sleep_gives_their_memory_back_and_wake_rebuilds_the_same_model(
    large: Path,
) -> None:
    runner = _runner(large)
    ops = Operations(runner)
    before = _greedy(runner)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert weight_bytes >= 50 * MiB
    rss = _settled_rss()

    slept = ops.sleep(["weights"])
    assert slept["freed_bytes"] >= weight_bytes and slept["asleep"] == ["weights"]
    assert slept["model_path"] == str(large)  # what waking loads
    assert rss - slept["rss_bytes"] >= 0.95 * weight_bytes
    assert all(p.numel() == 0 for p in runner.model.parameters())
    with pytest.raises(RuntimeError, match="weights sleep"):
        _greedy(runner)

    woke = ops.wake_up(["weights"])
    assert woke["model_path"] == str(large) and woke["allocated_bytes"] >= weight_bytes
    _assert_same(_greedy(runner), before)


@pytest.mark.skipif(memory._malloc_trim() is None, reason="not glibc: nothing to trim")
def test_freed_heap_blocks_go_back_to_the_system_only_once_released() -> None:
    # blocks under glibc's least mmap threshold, every other one freed: holes in the heap
    # between live blocks, which stay resident until the heap is trimmed
    blocks = [torch.ones(64 * 1024 // 4) for _ in range(2048)]
    rss = _settled_rss()
    del blocks[::2]
    assert rss - memory.rss_bytes() < 8 * MiB
    memory.release_memory(torch.device("cpu"))
    assert rss - memory.rss_bytes() >= 56 * MiB
    assert len(blocks) == 1024


def test_both_sleep_together_and_wake_in_either_order(tiny: Path) -> None:
    runner = _runner(tiny)
    ops = Operations(runner)
    before = _greedy(runner)
    assert ops.sleep(["weights", "kv_cache"])["asleep"] == ["kv_cache", "weights"]
    # the new layers have no cache to point at until it wakes
    assert ops.wake_up(["weights"])["asleep"] == ["kv_cache"]
    assert runner.model.model.stage_layers[0].self_attn.attn.k_cache.numel() == 0
    ops.wake_up(["kv_cache"])
    _assert_same(_greedy(runner), before)


def test_sleep_and_wake_refuse_what_cannot_be_done(tiny: Path, tmp_path: Path) -> None:
    ops = Operations(_runner(tiny))
    for tags in ([], ["kv_cache", "gpu"], "weights"):
        with pytest.raises(OperationError) as e:
            ops.sleep(tags)  # type: ignore[arg-type]
        assert e.value.kind == "invalid"
    with pytest.raises(OperationError) as e:
        ops.wake_up(["weights"])
    assert e.value.kind == "conflict"
    ops.sleep(["kv_cache"])
    with pytest.raises(OperationError) as e:
        ops.sleep(["kv_cache", "weights"])
    assert e.value.kind == "conflict"
    assert ops.memory()["asleep"] == ["kv_cache"]  # the refused sleep freed nothing

    config = {
        "kv_connector": "TriodeConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"secret_file": secret_file(tmp_path)},
    }
    with_connector = _runner(tiny, kv_transfer_config=config)
    try:
        with pytest.raises(OperationError) as e:
            Operations(with_connector).sleep(["kv_cache"])
        assert e.value.kind == "unsupported"
    finally:
        with_connector.shutdown()


# --- weights from disk ----------------------------------------------------------------------------


def test_update_from_disk_serves_what_a_fresh_runner_on_the_checkpoint_does(
    tiny: Path, tmp_path: Path
) -> None:
    changed = _copy_checkpoint(tiny, tmp_path / "changed", _perturbed(tiny))
    runner = _runner(tiny)
    ops = Operations(runner)
    before = _greedy(runner)
    result = ops.update_weights_from_disk(str(changed))
    assert result["loaded"] and result["model_path"] == str(changed)
    assert result["tensors"] == len(list(runner.model.parameters()))
    after = _greedy(runner)
    _assert_same(after, _greedy(_runner(changed)))
    assert after[1].tolist() != before[1].tolist()
    # the new checkpoint is what waking loads
    ops.sleep(["weights"])
    ops.wake_up(["weights"])
    _assert_same(_greedy(runner), after)


@pytest.mark.parametrize(
    ("architecture", "family"),
    [
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ],
)
def test_update_from_disk_of_a_mixture_of_experts_takes_its_experts_tensors(
    architecture: str, family: dict[str, int], root: Path, tmp_path: Path
) -> None:
    """A checkpoint holds one tensor per expert, as the model loads them: an update of them is
    checked against those names and shapes and gives what a fresh runner gives."""
    model = build_tiny_model(root / architecture, architecture=architecture, **family)  # type: ignore[arg-type]
    experts = [n for n in load_file(model / "model.safetensors") if ".experts." in n]
    changed = _copy_checkpoint(model, tmp_path / "changed", _perturbed(model, experts))
    runner = _runner(model)
    before = _greedy(runner)
    result = Operations(runner).update_weights_from_disk(str(changed))
    assert result["loaded"]
    after = _greedy(runner)
    _assert_same(after, _greedy(_runner(changed)))
    assert after[1].tolist() != before[1].tolist()
    # a tensor of an expert the config does not have is no parameter of the architecture
    extra = experts[0].replace(".experts.0.", ".experts.4.")
    wrong = _copy_checkpoint(model, tmp_path / "wrong", {extra: torch.zeros(1)})
    with pytest.raises(OperationError, match=r"experts\.4"):
        Operations(runner).update_weights_from_disk(str(wrong))
    _assert_same(_greedy(runner), after)


def test_update_from_disk_while_asleep_becomes_what_waking_loads(
    tiny: Path, tmp_path: Path
) -> None:
    changed = _copy_checkpoint(tiny, tmp_path / "changed", _perturbed(tiny))
    runner = _runner(tiny)
    ops = Operations(runner)
    ops.sleep(["weights"])
    assert ops.update_weights_from_disk(str(changed))["loaded"] is False
    with pytest.raises(OperationError) as e:
        ops.update_weights_from_disk(str(tmp_path / "nowhere"))
    assert e.value.kind == "invalid"  # checked while asleep too
    assert ops.wake_up(["weights"])["model_path"] == str(changed)
    _assert_same(_greedy(runner), _greedy(_runner(changed)))

    # a source gone by the time it wakes: the weights stay asleep, and wake from another
    gone = _copy_checkpoint(tiny, tmp_path / "gone")
    ops.sleep(["weights"])
    ops.update_weights_from_disk(str(gone))
    (gone / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        ops.wake_up(["weights"])
    assert ops.memory()["asleep"] == ["weights"]
    assert all(p.numel() == 0 for p in runner.model.parameters())
    ops.update_weights_from_disk(str(tiny))
    ops.wake_up(["weights"])
    _assert_same(_greedy(runner), _greedy(_runner(tiny)))


def _bad_checkpoints(tiny: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Checkpoints no update may take, each with what its refusal names."""
    tensors = load_file(tiny / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    out: dict[str, tuple[Path, str]] = {}

    def variant(name: str, edit: Any, names: str) -> None:
        path = _copy_checkpoint(tiny, root / name)
        edit(path)
        out[name] = (path, names)

    def config(**fields: Any) -> Any:
        def edit(path: Path) -> None:
            data = json.loads((path / "config.json").read_text()) | fields
            (path / "config.json").write_text(json.dumps(data))

        return edit

    def weights(change: dict[str, torch.Tensor], drop: str | None = None) -> Any:
        def edit(path: Path) -> None:
            new = {k: v for k, v in (tensors | change).items() if k != drop}
            save_file(new, path / "model.safetensors")

        return edit

    variant("architecture", config(architectures=["MistralForCausalLM"]), "Mistral")
    variant("hidden-size", config(hidden_size=128), "hidden_size")
    variant("untied", config(tie_word_embeddings=False), "tie_word_embeddings")
    variant("shape", weights({q: tensors[q][:32]}), q)
    variant("unknown", weights({"model.layers.0.mlp.extra.weight": tensors[q].clone()}), "extra")
    variant("int-dtype", weights({q: tensors[q].to(torch.int32)}), "I32")
    variant("missing", weights({}, drop=q), q)
    variant("no-config", lambda p: (p / "config.json").unlink(), "config.json")
    variant("corrupt", lambda p: (p / "model.safetensors").write_bytes(b"\x10" + bytes(15)), "")
    variant(
        "twice",
        lambda p: save_file({q: tensors[q]}, p / "model-2.safetensors"),
        "model-2.safetensors",
    )
    variant(
        "huge-config",
        lambda p: (p / "config.json").write_text(" " * (2 * MiB) + "{}"),
        "bytes",
    )
    variant("fifo", lambda p: os.mkfifo(p / "model-2.safetensors"), "not a regular file")
    out["not-a-directory"] = (tiny / "config.json", "not a directory")
    return out


def test_a_bad_checkpoint_is_refused_before_anything_loads(tiny: Path, tmp_path: Path) -> None:
    runner = _runner(tiny)
    ops = Operations(runner)
    before = _greedy(runner)
    for case, (path, named) in _bad_checkpoints(tiny, tmp_path).items():
        with pytest.raises(OperationError) as e:
            ops.update_weights_from_disk(str(path))
        assert e.value.kind == "invalid", case
        assert named in str(e.value), (case, str(e.value))
        assert ops.source == tiny
    for not_a_path in (7, "", None):
        with pytest.raises(OperationError) as e:
            ops.update_weights_from_disk(not_a_path)  # type: ignore[arg-type]
        assert e.value.kind == "invalid"
    _assert_same(_greedy(runner), before)


# --- pushed weights -------------------------------------------------------------------------------

PARTIAL = [
    "model.layers.0.self_attn.q_proj.weight",  # one shard of the merged QKV projection
    "model.layers.1.mlp.up_proj.weight",  # one of gate_up
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.embed_tokens.weight",  # tied: the LM head takes it too
]


def _push(ops: Operations, *buckets: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    ops.start_weight_update()
    for bucket in buckets:
        ops.apply_weights(bucket)
    return ops.finish_weight_update()


def test_a_partial_push_serves_what_a_fresh_runner_on_the_patched_checkpoint_does(
    tiny: Path, tmp_path: Path
) -> None:
    change = _perturbed(tiny, PARTIAL)
    patched = _copy_checkpoint(tiny, tmp_path / "patched", change)
    runner = _runner(tiny)
    ops = Operations(runner)
    before = _greedy(runner)
    # bfloat16 and float64 tensors are cast; the tied LM head is accepted and skipped
    items = [(name, t.to(torch.float64)) for name, t in change.items()]
    items.append(("lm_head.weight", torch.zeros_like(change["model.embed_tokens.weight"])))
    result = _push(ops, items[:2], items[2:])
    assert result["tensors"] == 5 and result["int4_detached"] == 0
    after = _greedy(runner)
    _assert_same(after, _greedy(_runner(patched)))
    assert after[1].tolist() != before[1].tolist()


@pytest.mark.parametrize(
    "bad",
    [
        ("model.layers.0.mlp.extra.weight", torch.zeros(128, 64)),
        ("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 32)),
        ("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64, dtype=torch.int64)),
        ("model.norm.weight", torch.zeros(64, dtype=torch.bool)),
        ("model.norm.weight", [1.0] * 64),
    ],
    ids=["unknown-name", "wrong-shape", "int-dtype", "bool-dtype", "not-a-tensor"],
)
def test_a_bad_tensor_refuses_its_whole_bucket(tiny: Path, bad: tuple[str, Any]) -> None:
    runner = _runner(tiny)
    ops = Operations(runner)
    before = _greedy(runner)
    good = list(_perturbed(tiny, PARTIAL).items())
    ops.start_weight_update()
    with pytest.raises(OperationError) as e:
        ops.apply_weights([*good, bad])
    assert e.value.kind == "invalid" and bad[0] in str(e.value)
    assert ops.finish_weight_update()["tensors"] == 0
    _assert_same(_greedy(runner), before)


def test_a_bucket_is_checked_by_its_specs_before_its_tensors_exist(tiny: Path) -> None:
    runner = _runner(tiny)
    ops = Operations(runner)
    good = [
        ("model.norm.weight", torch.bfloat16, (64,)),
        ("lm_head.weight", torch.float32, (runner.vocab_size, 64)),
    ]
    with pytest.raises(OperationError) as e:
        ops.check_weights(good)
    assert e.value.kind == "conflict"
    ops.start_weight_update()
    ops.check_weights(good)
    bad = {
        "model.layers.0.mlp.extra.weight": (
            "model.layers.0.mlp.extra.weight",
            torch.float32,
            (64,),
        ),
        "[64, 32]": ("model.layers.0.self_attn.q_proj.weight", torch.float32, (64, 32)),
        "uint8": ("model.layers.0.input_layernorm.weight", torch.uint8, (64,)),
        "twice": ("model.norm.weight", torch.float32, (64,)),
        "(name, dtype, shape)": ("model.norm.weight", "float32", (64,)),
    }
    for named, spec in bad.items():
        with pytest.raises(OperationError) as e:
            ops.check_weights([*good, spec])
        assert e.value.kind == "invalid" and named in str(e.value)


def test_pushes_keep_their_order(tiny: Path) -> None:
    runner = _runner(tiny)
    ops = Operations(runner)
    bucket = [("model.norm.weight", torch.ones(64))]
    for call in (lambda: ops.apply_weights(bucket), ops.finish_weight_update):
        with pytest.raises(OperationError) as e:
            call()
        assert e.value.kind == "conflict" and "start_weight_update" in str(e.value)
    ops.start_weight_update()
    for call in (ops.start_weight_update, lambda: ops.sleep(["weights"])):
        with pytest.raises(OperationError) as e:
            call()
        assert e.value.kind == "conflict"
    ops.finish_weight_update()
    ops.sleep(["weights"])
    for call in (ops.start_weight_update, lambda: ops.apply_weights(bucket)):
        with pytest.raises(OperationError) as e:
            call()
        assert e.value.kind == "conflict" and "wake_up with tags=weights" in str(e.value)


def test_a_push_into_packed_projections_unpacks_them_and_packs_them_again(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # oneDNN packs float32 weights on any x86 CPU: the packed path, where the pushed shard of a
    # merged projection must keep its other shards' values from the packed copy
    monkeypatch.setattr(model_runner, "cpu_weight_packing_supported", lambda dtype: True)
    change = _perturbed(tiny, PARTIAL)
    patched = _copy_checkpoint(tiny, tmp_path / "patched", change)
    runner = _runner(tiny)
    qkv = runner.model.model.stage_layers[0].self_attn.qkv_proj
    assert qkv.packed is not None and qkv.weight.numel() == 0
    ops = Operations(runner)
    result = _push(ops, list(change.items()))
    assert result["packed"] == 4  # QKV, gate_up, o_proj and the tied LM head
    assert qkv.packed is not None and qkv.weight.numel() == 0
    _assert_same(_greedy(runner), _greedy(_runner(patched)))
    # a sleep frees the packed copies too; waking packs the source's weights again
    packed_bytes = sum(
        memory.tensor_bytes([m.packed])
        for m in runner.model.modules()
        if getattr(m, "packed", None) is not None
    )
    assert ops.sleep(["weights"])["freed_bytes"] >= packed_bytes > 0
    assert all(getattr(m, "packed", None) is None for m in runner.model.modules())
    ops.wake_up(["weights"])
    assert runner.model.model.stage_layers[0].self_attn.qkv_proj.packed is not None
    _assert_same(_greedy(runner), _greedy(_runner(tiny)))


def _as_gguf(tiny: Path, root: Path) -> Path:
    """`tiny` written as a GGUF file with 4-bit projections and an 8-bit embedding (as
    llama.cpp's converter writes one), served from its converted directory."""
    return convert_gguf(write_gguf(tiny, root / "tiny-q4_0.gguf"))


@pytest.mark.skipif(
    not int4.kernel_available(torch.bfloat16, torch.device("cpu")),
    reason="this torch has no int4 CPU kernel",
)
def test_new_weights_detach_the_4_bit_codes_they_replace(tiny: Path, tmp_path: Path) -> None:
    quantized = _as_gguf(tiny, tmp_path)
    change = {n: t + 0.01 for n, t in checkpoint_weights(quantized) if n.endswith("proj.weight")}
    # the same weights as a plain checkpoint, which runs dense
    changed = _copy_checkpoint(
        tiny, tmp_path / "changed", dict(checkpoint_weights(quantized)) | change
    )
    # the LM head dense, as the plain checkpoint's: the projections run the file's blocks,
    # with no dense copy
    options = {"dtype": "bfloat16", "quantization": "dense-head"}
    runner = _runner(quantized, **options)
    projections = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert runner.quantized_projections == len(projections) == 8
    assert all(m.packed_only for m in projections)
    ops = Operations(runner)
    ops.start_weight_update()
    first = ops.apply_weights([(n, t) for n, t in change.items() if ".0." in n])
    assert first["tensors"] > 0 and runner.quantized_projections == 4
    result = ops.apply_weights([(n, t) for n, t in change.items() if ".0." not in n])
    assert result["tensors"] > 0
    assert ops.finish_weight_update()["int4_detached"] == 8
    assert runner.quantized_projections == 0
    assert all(m.int4 is m.quant is None and not m.packed_only for m in projections)
    _assert_same(_greedy(runner), _greedy(_runner(changed, **options)))
    # from disk: the old weights go, the file's own come back, as a start on it takes them
    result = ops.update_weights_from_disk(str(quantized))
    assert (result["int4_detached"], result["int4_attached"]) == (0, 8)
    _assert_same(_greedy(runner), _greedy(_runner(quantized, **options)))


# --- profiling ------------------------------------------------------------------------------------


def test_a_profile_holds_the_steps_run_on_another_thread(tiny: Path, tmp_path: Path) -> None:
    runner = _runner(tiny)
    ops = Operations(runner)
    calls = concurrent.futures.ThreadPoolExecutor(1)
    steps = concurrent.futures.ThreadPoolExecutor(1)
    with calls, steps:
        steps.submit(_greedy, runner, 1).result()  # the step thread exists before the start
        started = calls.submit(ops.start_profile, str(tmp_path / "traces"), "run-").result()
        assert started["file"] == str(tmp_path / "traces" / "run-rank-0.json")
        with pytest.raises(OperationError) as e:
            ops.start_profile(str(tmp_path), "again-")
        assert e.value.kind == "conflict"
        steps.submit(_greedy, runner, 2).result()
        stopped = steps.submit(ops.stop_profile).result()  # stopped from a third thread
    assert stopped["files"] == [started["file"]]
    trace = json.loads(Path(started["file"]).read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names  # the projections
    assert list((tmp_path / "traces").iterdir()) == [Path(started["file"])]
    with pytest.raises(OperationError) as e:
        ops.stop_profile()
    assert e.value.kind == "conflict"


@pytest.mark.parametrize("prefix", ["../up-", "a/b", "nul\x00", "x" * 129])
def test_a_profile_prefix_names_a_file_in_the_directory_only(
    tiny: Path, tmp_path: Path, prefix: str
) -> None:
    ops = Operations(_runner(tiny))
    with pytest.raises(OperationError) as e:
        ops.start_profile(str(tmp_path), prefix)
    assert e.value.kind == "invalid"
    assert ops.start_profile(str(tmp_path), "ok-")["file"].startswith(str(tmp_path))
    ops.stop_profile()
