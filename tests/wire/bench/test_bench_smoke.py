import pytest

from triode.wire import bench

TINY = bench.Options(
    messages=50, round_trips=20, window=8, rounds=1, codec_repeats=1, codec_min_time=0.001
)


@pytest.mark.slow
def test_tiny_run_fills_every_row_of_the_table() -> None:
    results, notes = bench.run(TINY)

    assert [(r.section, r.name) for r in results] == [
        ("codec", "EngineCoreRequest, 1000-token prompt"),
        ("codec", "EngineCoreOutputs, 256 x 1 token"),
        ("transport", "throughput, msg/s"),
        ("transport", "round trip p50, µs"),
        ("transport", "round trip p99, µs"),
    ]
    assert all(r.first > 0 and r.second > 0 and r.ratio > 0 for r in results)
    table = bench.format_table(results, notes)
    for r in results:
        line = next(line for line in table.splitlines() if r.name in line)
        assert line.endswith("MET") == (r.target is not None)
