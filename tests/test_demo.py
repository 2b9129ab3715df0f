"""The demo's job on real gloo ranks, and its options."""

import dataclasses

import pytest

from cpshard.tools.demo import DemoConfig, demo_job, demo_passed, format_report

TINY = dict(nprocs=2, steps=2, layers=2, hidden=64, heads=4, vocab=128)


@pytest.mark.parametrize(
    "config",
    [
        DemoConfig(seq=64, kv_heads=2, **TINY),
        DemoConfig(seq=63, kv_heads=1, **TINY),  # padding to a multiple of cp, and kv heads replicated
    ],
    ids=["divisible-gqa", "padded-replicated-kv"],
)
def test_demo_job_is_exact_and_communicates_the_optimum(ranks2, config):
    reports = ranks2.run(demo_job, config)
    assert demo_passed(reports), format_report(config, reports)
    for report in reports:
        for step in report.steps:
            assert step.bytes_by_op["all_to_all"] == report.optimum.all_to_all
            assert abs(sum(step.bytes_by_op.values()) / report.optimum.total - 1) < 0.05, step.bytes_by_op
        assert report.peak_rss >= report.start_rss > 0
    assert reports[0].steps[1].loss < reports[0].steps[0].loss  # AdamW moved downhill
    text = format_report(config, reports)
    assert "PASS" in text and "all_to_all" in text and "median step" in text


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"seq": 0}, "--seq"),
        ({"nprocs": 3}, "--nprocs"),
        ({"kv_heads": 3}, "--kv-heads"),
        ({"lr": 0.0}, "--lr"),
    ],
)
def test_bad_options_name_the_flag(change, flag):
    with pytest.raises(ValueError, match=flag):
        dataclasses.replace(DemoConfig(), **change)
