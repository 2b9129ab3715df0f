"""cpshard bench: rows for every variant, bytes against the optimum, notes for absent baselines,
usage errors."""

import dataclasses
import sys

import pytest

from cpshard.bench import compiled, measure, report
from cpshard.bench.config import BenchConfig
from cpshard.bench.variants import ONE_PROCESS, PEERS, VARIANTS
from cpshard.cli import build_parser, main
from cpshard.debug.optimum import optimum_of
from cpshard.tools.tiny import tiny_model
from cpshard.tools.usage import UsageError

CONFIG = BenchConfig(
    seqs=(64,),
    cps=(2,),
    layers=1,
    hidden=32,
    heads=4,
    kv_heads=2,
    vocab=64,
    repeats=1,
    variants=VARIANTS,
)
OPTIONAL = ("deepspeed", "yunchang", "alst")


def rank_job_without_optional(config, seq, variants):
    """On a rank: the bench's job with the optional baselines' packages made unimportable."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] in OPTIONAL}
    blocked = ["deepspeed", "yunchang", "deepspeed.sequence.layer", "yunchang.comm.all_to_all"]
    sys.modules.update(dict.fromkeys(blocked))  # None in sys.modules: importing it raises ImportError
    try:
        return measure.rank_job(config, seq, variants)
    finally:
        for name in blocked:
            del sys.modules[name]
        sys.modules.update(saved)


def test_rows_times_bytes_and_optimum(ranks2):
    rows, notes = measure.measure(ranks2, CONFIG, 64)
    by_name = {row.variant: row for row in rows}
    absent = {name for name in OPTIONAL if measure.missing(name)}
    assert set(by_name) == set(CONFIG.variants) - absent - {"hybrid"}
    assert len(notes) == 1 + len(absent)  # hybrid does not fit cp=2, and one line per absent baseline
    for row in rows:
        assert row.seconds > 0 and row.cpu_seconds > 0 and row.tokens_per_second > 0 and row.peak_mib > 0
        assert row.rss_mib is not None  # beside the live tensors' peak, the resident size
        assert (row.bytes_sent > 0) == (row.variant not in ONE_PROCESS), row
    optimum = optimum_of(tiny_model("llama", **CONFIG.model_sizes()), 1, 64, 2)
    ulysses = by_name["ulysses"]
    assert ulysses.bytes_by_op["all_to_all"] == optimum.all_to_all
    assert ulysses.bytes_by_op["all_reduce"] == optimum.all_reduce
    assert ulysses.bytes_sent - ulysses.bytes_by_op.get("all_gather", 0) == optimum.total == ulysses.optimum
    assert (
        ulysses.bytes_by_op["counted"] == ulysses.bytes_sent
    )  # what torch dispatched is what cpshard recorded
    assert by_name["ring"].bytes_by_op["send"] > 0
    for peer in set(PEERS) - absent - {"alst"}:  # one all-reduce: the gradients and the loss
        assert by_name[peer].bytes_by_op["all_reduce"] == optimum.all_reduce
    if "alst" not in absent:  # its exchanges, and its own loss and tiling collectives besides
        assert by_name["alst"].bytes_by_op["all_to_all"] > 0 and by_name["alst"].bytes_by_op["all_gather"] > 0

    report.add_ratios(rows)
    assert by_name["single"].memory_ratio == 1.0 and by_name["single"].time_ratio is None
    assert by_name["cp1"].cp == 1 and by_name["cp1"].time_ratio > 0  # cp=1 against the plain model
    peers = [by_name[p] for p in set(PEERS) - absent]
    assert (
        min(peers, key=lambda r: r.seconds).time_ratio == 1.0
        and min(peers, key=lambda r: r.cpu_seconds).cpu_ratio == 1.0
    )
    table = report.format_table(rows)
    assert all(name in table for name in by_name) and "tokens/s" in table
    assert any(line.startswith("  time, cp=2, L=64") for line in report.targets(rows))


def test_compiled_rows_against_eager(ranks2):
    # the "eager" backend: dynamo's trace and the same cp steps at a fraction of inductor's compile time
    config = dataclasses.replace(
        CONFIG, seqs=(32, 64), variants=("single", "ulysses", "ulysses-checkpointed")
    )
    assert compiled.compiled_variants(config, 2) == ("ulysses", "ulysses-checkpointed")
    rows = compiled.measure(ranks2, config, "eager")
    assert [(row.variant, row.seq) for row in rows] == [
        (v, n) for v in ("ulysses", "ulysses-checkpointed") for n in (32, 64)
    ]
    for row in rows:
        assert row.cp == 2 and row.compile_seconds > 0 and row.eager_seconds > 0 and row.compiled_seconds > 0
        assert row.time_ratio > 0 and row.cpu_ratio > 0 and row.breaks == 0 and row.loss_diff <= 1e-5, row
    assert [row.graphs for row in rows] == [1, 0, 1, 0], "one graph per variant, for both lengths"
    table = compiled.format_table(rows)
    assert "first compiled call s" in table and len(table.splitlines()) == 2 + len(rows)


def test_compile_flag_names_a_backend(capsys):
    assert build_parser().parse_args(["bench", "--compile"]).compile == "inductor"
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--compile", "nosuch"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--compile nosuch: not a torch.compile backend" in err


def test_absent_baselines_give_notes(ranks2):
    variants = ("ulysses", "deepspeed", "yunchang")
    results = ranks2.run(rank_job_without_optional, CONFIG, 32, variants)
    notes = results[0]["notes"]
    assert [note.split()[0] for note in notes] == ["deepspeed", "yunchang"]
    assert all("skipped" in note and "\n" not in note for note in notes)
    rows = measure._rows(results, CONFIG, 32)
    assert [row.variant for row in rows] == ["ulysses"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seqs", "0"], "--seqs"),
        (["--cp", "1"], "--cp"),
        (["--variants", "megatron"], "--variants megatron"),
        (["--heads", "3"], "--heads=3 must divide --hidden=256"),
        (["--repeats", "x"], "invalid int value"),
    ],
)
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["bench", *argv])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plot_without_matplotlib(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--plot", "out.png"])
    assert exit.value.code == 2 and "--plot needs matplotlib" in capsys.readouterr().err


def test_models_name_sizes_that_flags_change():
    small = BenchConfig.of_model("vocab1k", vocab=2048)
    sizes = small.model_sizes()
    assert (sizes["vocab_size"], sizes["intermediate_size"], sizes["hidden_size"]) == (2048, 688, 256)
    assert BenchConfig.of_model("vocab32k").model_sizes()["intermediate_size"] == 4 * 256
    with pytest.raises(UsageError, match="--model vocab7"):
        BenchConfig.of_model("vocab7")
