"""The stats of several engine cores (data parallelism) as one: `sum_stat_dicts`."""

from __future__ import annotations

from triode.actors.engine import sum_stat_dicts


def test_numbers_add_lists_add_by_position_and_usage_weighs_by_blocks() -> None:
    one = {"steps": 3, "spec_num_accepted_tokens_per_pos": [4, 2, 1], "kv_cache_usage": 0.5,
           "num_total_blocks": 100, "dtype": "float32", "ok": True}  # fmt: skip
    two = {"steps": 5, "spec_num_accepted_tokens_per_pos": [1, 1, 0, 7], "kv_cache_usage": 0.0,
           "num_total_blocks": 300}  # fmt: skip
    total = sum_stat_dicts([one, two])
    assert total["steps"] == 8
    assert total["spec_num_accepted_tokens_per_pos"] == [5, 3, 1, 7]
    assert total["kv_cache_usage"] == 0.125
    assert "dtype" not in total and "ok" not in total
    assert one["spec_num_accepted_tokens_per_pos"] == [4, 2, 1]  # the inputs stay as they were
    assert sum_stat_dicts([one]) == one
