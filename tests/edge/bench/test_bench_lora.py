"""`triode bench lora`: its random adapters are PEFT adapters that change the model, and the
table puts each adapter load beside the base with its ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from triode.edge.bench.lora import format_table, parse_args
from triode.gpu.loader import transformers_directory
from triode.gpu.lora.random_adapter import ALL_TARGETS, write_random_adapter
from triode.gpu.tiny_model import build_tiny_model


def test_a_random_adapter_loads_into_peft_and_changes_the_logits(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "model", num_layers=2)
    adapter = write_random_adapter(model_dir, tmp_path / "adapter", rank=8, seed=1)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and set(config["target_modules"]) == set(ALL_TARGETS)

    base = AutoModelForCausalLM.from_pretrained(
        transformers_directory(model_dir), dtype=torch.float32
    ).eval()
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.inference_mode():
        before = base(ids).logits
        tuned = peft.PeftModel.from_pretrained(base, adapter).eval()
        after = tuned(ids).logits
    # every projection of every layer took its tensors (PEFT warns, not fails, on missing ones)
    lora_layers = [m for m in tuned.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert len(lora_layers) == 2 * len(ALL_TARGETS)
    assert not torch.allclose(before, after, atol=1e-3)


def _row(load: str, streams: int, throughput: float, round_: int = 0) -> dict[str, object]:
    return {"load": load, "concurrency": streams, "round": round_, "failed": 0,
            "output_throughput": throughput, "median_tpot_ms": 1000.0 / throughput,
            "duration_s": 10.0, "total_output_tokens": 10.0 * throughput}  # fmt: skip


def test_each_stream_count_puts_the_adapters_beside_the_base_with_median_ratios() -> None:
    args = parse_args(["--concurrencies", "1,32", "--rounds", "3"])
    rows = []
    # the machine slows down over the rounds: each round's ratio holds, the totals do not
    for round_, speed in enumerate((1.0, 0.5, 0.8)):
        for load, rate in (("base", 40.0), ("one adapter", 38.0), ("mixed adapters", 36.0)):
            rows.append(_row(load, 1, rate * speed, round_))
    rows += [_row("base", 32, 400.0), _row("one adapter", 32, 380.0)]
    rows += [_row("mixed adapters", 32, 340.0)]

    table = format_table(rows, args)

    body = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and
            line[2].isdigit()]  # fmt: skip
    assert [(r[0].strip("| "), r[1], r[3], r[5]) for r in body] == [
        ("1", "30.7", "0.95x", "0.90x"),
        ("32", "400.0", "0.95x", "0.85x"),
    ]


def test_options_are_checked() -> None:
    assert parse_args([]).concurrency_list == [1, 8, 32]
    for bad in (["--concurrencies", "0"], ["--rank", "0"], ["--adapters", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
