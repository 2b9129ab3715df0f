"""What ``cpshard bench`` makes of its rows: ratios round by round, the table, the JSON file (the rows of a
real run, with the targets, are in ``tests/test_bench.py``)."""

import json

import pytest

from cpshard.bench import report as bench_report
from cpshard.bench.config import BenchConfig


def test_paired_ratio_takes_each_round_against_its_own():
    ours, theirs = (
        [0.9, 1.8, 1.8],
        [1.0, 2.0, 1.0],
    )  # rounds' ratios 0.9, 0.9, 1.8; the medians' ratio would be 1.8
    assert bench_report.paired_ratio(ours, theirs) == pytest.approx(0.9)
    assert bench_report.paired_ratio([0.9, 2.7], [1.0, 3.0]) == pytest.approx(0.9)


def test_json_file(tmp_path):
    row = bench_report.Row("ulysses", 2, 64, 0.5, 0.6, 10.0, 100, 100, {"all_to_all": 100}, optimum=100)
    assert "ulysses" in bench_report.format_table([row])  # a row without a resident size reads "-" there
    bench_report.write_json([row], BenchConfig(seqs=(64,)), tmp_path / "rows.json")
    written = json.loads((tmp_path / "rows.json").read_text())
    assert written["rows"][0]["tokens_per_second"] == 128 and written["config"]["seqs"] == [64]


def test_every_variant_says_what_it_is():
    from cpshard.bench.variants import MEANINGS, VARIANTS

    assert set(MEANINGS) == set(VARIANTS)
