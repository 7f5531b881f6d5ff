"""`triode bench throughput`'s bfloat16-against-float32 verdict."""

from __future__ import annotations

from triode.edge.bench.throughput import Agreement, Greedy, _table, agreement


def test_agreement_names_where_texts_part_and_float32s_margin_there() -> None:
    f32 = [
        Greedy([5, 6, 7], [{5: -0.1}, {6: -0.5, 9: -0.52}, {7: -0.2}]),
        Greedy([1, 2], [{1: -0.3, 4: -2.0}, {2: -0.1, 3: -3.0}]),
        Greedy([8, 8], [{8: -0.1, 2: -2.0}, {8: -0.1}]),
    ]
    bf16 = [
        Greedy([5, 9, 7], []),  # parts at token 1, where float32 nearly tied
        Greedy([1, 2], []),
        Greedy([3, 8], []),  # parts at token 0 with a token float32 does not rank in its top 5
    ]
    result = agreement(bf16, f32)
    assert (result.agree, result.prompts) == (1, 3)
    assert result.partings == [
        "prompt 0, token 1: float32 ranks bfloat16's token 0.020 nats below its own",
        "prompt 2, token 0: float32 ranks bfloat16's token outside its top 5, more than "
        "1.900 nats below its own",
    ]


def test_table_marks_each_target() -> None:
    ours = {"single_tok_s": 60.0, "concurrent": 64, "concurrent_tok_s": 900.0, "ttft_s": 0.03,
            "peak_rss_mb": 1400.0, "dtype": "bfloat16", "model_dir": "m"}  # fmt: skip
    hf = {"single_tok_s": 27.0, "batch": 16, "batch_tok_s": 500.0, "ttft_s": 0.04,
          "peak_rss_mb": 1100.0}  # fmt: skip
    table = _table(ours, hf, Agreement(4, 4, []))
    lines = table.splitlines()
    assert lines[1].endswith(">= 2x MET")  # 60 >= 2 x 27
    assert lines[2].endswith(">= 2x NOT MET")  # 900 < 2 x 500
    assert "4/4 prompts  MET" in table
