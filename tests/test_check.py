"""``cpshard check``: passes on supported models and folders, fails (exit 1, rows named) on a broken
layout, and refuses bad usage with one line and exit 2 before any rank starts."""

import subprocess
import sys

import pytest
import torch

from cpshard.cli import main
from cpshard.layouts.decoder import LAYOUT as DECODER
from cpshard.parallel.mesh import make_mesh
from cpshard.parallel.processes import RankError
from cpshard.runtime.forward import make_cp_forward
from cpshard.spec.notation import Spec
from cpshard.tools.check import (
    CheckConfig,
    check_job,
    exit_status,
    float64_look,
    format_report,
    plan,
    rounding_job,
)
from cpshard.tools.check_config import parse_override
from cpshard.tools.check_report import reported
from cpshard.tools.model_source import build_model, resolve_source
from cpshard.tools.parity import Parity, Rounding, check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model

#: cuts the sequence but never moves q, k, v: each rank attends within its own slice only
BROKEN = DECODER.with_rows(
    name="broken",
    qkv=(Spec("b h s@cp d"), Spec("b h s@cp d")),
    attn_output=(Spec("b s h@cp d"), Spec("b s h@cp d")),
)


@pytest.mark.parametrize(
    "config",
    [
        CheckConfig("llama", seq=16),
        CheckConfig("qwen3", implementation="ring", seq=15, batch=3, pad="left", packed=True),
        CheckConfig("llama", seq=16, dtype="bfloat16", attn="eager"),
        CheckConfig("llama", seq=16, autocast="bfloat16", implementation="ring"),
    ],
    ids=["llama-ulysses", "qwen3-ring-pad-packed", "llama-bf16-eager", "llama-ring-under-bf16-autocast"],
)
def test_check_passes_on_supported_models(ranks2, config):
    parities = ranks2.run(check_job, config)
    report = format_report(config, parities)
    assert exit_status(config, parities) == 0, report
    assert report.splitlines()[-1] == f"PASS: {len(parities[0].diffs)} rows on 2 ranks"
    assert "grad model.layers.1.self_attn" in report and "logits" in report


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_broken_layout_is_refused_by_the_probe_on_every_rank(ranks2, dtype):
    """A layout that is not a tested file is probed first: one that leaves q, k, v local never runs."""
    config = CheckConfig("llama", seq=16, dtype=dtype)
    with pytest.raises(RankError) as caught:
        ranks2.run(check_job, config, BROKEN)
    failures = caught.value.failures
    assert sorted(failures) == [0, 1]
    for failure in failures.values():
        assert failure.kind == "LayoutError" and "cannot vouch for layout 'broken'" in failure.message


def test_pass_rule_is_relative_to_each_rows_scale():
    diffs, scales = (
        {"loss": 1e-6, "logits": 1e-6, "grad lm_head": 0.0},
        {"loss": 1.0, "logits": 1e-3, "grad lm_head": 0.0},
    )
    parity = Parity(diffs, scales, comm_bytes=0)
    assert parity.passes() == {"loss": True, "logits": False, "grad lm_head": True}
    assert parity.passes(rtol=1e-2)["logits"]
    config = CheckConfig("llama")
    assert (
        exit_status(config, [parity]) == 1
        and exit_status(CheckConfig("llama", dtype="bfloat16"), [parity]) == 0
    )
    assert (
        format_report(config, [parity]).splitlines()[-1]
        == "FAIL: 1 of 3 rows differ beyond 1e-05 x scale: logits"
    )


def test_local_folders_with_and_without_weights(ranks2, tmp_path):
    saved = tiny_model("llama", seed=5)
    saved.save_pretrained(tmp_path / "weights")
    saved.config.save_pretrained(tmp_path / "config-only")
    assert resolve_source(str(tmp_path / "weights")).weights
    assert not resolve_source(str(tmp_path / "config-only")).weights
    loaded = build_model(resolve_source(str(tmp_path / "weights")), CheckConfig(str(tmp_path / "weights")))
    assert all(torch.equal(p, saved.get_parameter(n)) for n, p in loaded.named_parameters())
    for folder in ("weights", "config-only"):
        config = CheckConfig(str(tmp_path / folder), seq=12)
        assert str(tmp_path / folder) in plan(config)
        parities = ranks2.run(check_job, config)
        assert exit_status(config, parities) == 0, format_report(config, parities)


def test_a_model_cpshard_refuses_exits_1_as_a_failed_check(capsys):
    assert main(["check", "xlnet"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("cpshard check: cpshard cannot serve model type 'xlnet'")
    assert "--help" not in error


@pytest.mark.parametrize(
    "argv, says",
    [
        (["no_such_type"], "unknown model type 'no_such_type'"),
        (["{missing}"], "no folder '{missing}'"),
        (["{tmp}"], "has no config.json"),
        (["llama", "--cp", "0"], "--cp=0 must be at least 1"),
        (["llama", "--pad", "left", "--seq", "3"], "--pad left needs --seq of at least 4"),
        # the loss was NaN in one process (0 / 0) and 0 under cp, and the NaN row passed as rounding
        (["llama", "--seq", "1"], "--seq=1 leaves no token to predict"),
        (["llama", "--implementation", "hybrid"], "hybrid needs a Ulysses degree"),
        (["llama", "--cp", "3", "--implementation", "ulysses"], "not divisible by cp=3"),
        (["t5"], "model type 't5' has no causal LM"),
        (["llama", "--dtype", "float16"], "invalid choice: 'float16'"),
        (["llama", "--set", "num_hidden_layers"], "write --set key=value"),
        (["llama", "--dtype", "bfloat16", "--autocast", "bfloat16"], "use it with --dtype float32"),
        (["llama", "--set", "no_such_field=3"], "has no field 'no_such_field'"),
        (["mamba2", "--set", "num_heads=3"], "cannot build random mamba2 (small)"),  # its validator's error
        (["gpt_neo", "--attn", "sdpa"], "does not support --attn sdpa: use --attn eager"),
        (
            [
                "llama",
                "--cp",
                "4",
                "--implementation",
                "ulysses",
                "--set",
                "num_attention_heads=6",
                "--set",
                "hidden_size=96",
            ],
            "num_attention_heads=6 is not divisible by cp=4",
        ),
    ],
)
def test_bad_usage_exits_2_with_one_line(capsys, tmp_path, argv, says):
    fill = dict(missing=str(tmp_path / "missing"), tmp=str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(["check", *(arg.format(**fill) for arg in argv)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says.format(**fill) in err and err.count("\n") == 1, err


@pytest.mark.ranks
@pytest.mark.parametrize(
    "model, attn", [("llama", "sdpa"), ("gpt_neo", "eager"), ("xlm", "eager"), ("deepseek_v4", "eager")]
)
def test_the_default_attention_is_sdpa_where_the_model_has_it_else_eager(model, attn):
    assert f"float32, {attn} attention," in plan(CheckConfig(model))
    assert build_model(resolve_source(model), CheckConfig(model)).config._attn_implementation == attn


def test_command_line_prints_progress_and_a_passing_table():
    result = subprocess.run(
        [sys.executable, "-m", "cpshard", "check", "llama", "--cp", "2", "--seq", "16"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "starting 2 local CPU ranks" in out and "running cp and one process" in out
    assert "grad lm_head" in out and out.rstrip().endswith("PASS: 13 rows on 2 ranks"), out


def test_set_overrides_reach_the_model_on_every_rank(ranks2):
    """``--set`` values are read as JSON (else strings) and the ranks build the model with them."""
    assert parse_override("sliding_window=5") == ("sliding_window", 5)
    assert parse_override("rope_scaling=null") == ("rope_scaling", None)
    assert parse_override("hidden_act=gelu") == ("hidden_act", "gelu")
    config = CheckConfig("mistral", seq=12, overrides=(("sliding_window", 5), ("num_hidden_layers", 3)))
    parities = ranks2.run(check_job, config)
    layers = {row.split(".")[2] for row in parities[0].diffs if row.startswith("grad model.layers.")}
    assert layers == {"0", "1", "2"}
    assert failing_rows(parities) == []


@pytest.mark.ranks  # starts its own ranks
def test_a_refusal_inside_the_ranks_is_one_line(capsys):
    """A model cp refuses where only running it shows why (MusicGen's decoder takes ids per codebook): the
    ranks' LayoutError in one line, no traceback."""
    assert main(["check", "musicgen", "--cp", "2"]) == 1
    err = capsys.readouterr().err
    assert "raised LayoutError: cpshard cannot serve model type 'musicgen_decoder'" in err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_a_hybrid_with_linear_attention_passes(ranks2):
    """qwen3_next: a Gated DeltaNet layer and an attention layer, every row within tolerance. Each rank's
    slice starts on the kernel's chunk grid (two chunks of 64 a rank): off it, the chunked kernel's fp32
    rounding alone moves one process's logits by about 2e-5 of scale (see tests/test_recurrent.py, and the
    float64 look below)."""
    parities = ranks2.run(check_job, CheckConfig("qwen3_next", seq=256))
    assert any(row.startswith("grad model.layers.0.linear_attn") for row in parities[0].diffs)
    assert failing_rows(parities) == []


def _rows(**values) -> dict:
    return {
        "loss": values.get("loss", 0.0),
        "logits": values.get("logits", 0.0),
        "grad lm_head": values.get("grad", 0.0),
    }


@pytest.mark.parametrize(
    "grad_from_float64, status, verdict",
    [
        (1.5e-5, 0, "PASS: 3 rows on 1 ranks (2 within fp32 rounding, as the float64 runs above show)"),
        (4e-5, 1, "FAIL: 1 of 3 rows differ beyond 1e-05 x scale: grad lm_head"),
    ],
    ids=["within-rounding", "beyond"],
)
def test_a_failing_row_within_fp32_rounding_of_float64_passes_and_one_beyond_fails(
    grad_from_float64, status, verdict
):
    """fp32 rows that fail at 1e-5 get a second look against a float64 run: within twice one process's own
    distance from it (or 1e-5 of scale) a row is rounding; farther, cp's own error."""
    config = CheckConfig("llama")
    parity = Parity(_rows(logits=3e-5, grad=3e-5), _rows(loss=1.0, logits=1.0, grad=1.0), comm_bytes=0)
    rounding = Rounding(
        cp=_rows(logits=1.3e-5, grad=grad_from_float64),
        own=_rows(logits=2.3e-5, grad=1e-5),
        scales=_rows(loss=1.0, logits=1.0, grad=1.0),
    )
    assert exit_status(config, [parity]) == 1  # without the second look: the fp32 verdict
    report = format_report(config, [parity], [rounding])
    assert exit_status(config, [parity], [rounding]) == status, report
    lines = report.splitlines()
    assert lines[-1].startswith(verdict), report
    assert lines[2].endswith("pass") and lines[3].endswith("pass (fp32 rounding)"), report
    assert lines[4].endswith("pass (fp32 rounding)" if status == 0 else "FAIL"), report
    assert "  logits: cp 1.3e-05, one process 2.3e-05" in lines


@pytest.mark.parametrize("cp_run_in_float64, status", [(4e-8, 0), (3e-5, 1)], ids=["same", "other"])
def test_a_row_beyond_twice_one_process_passes_where_cp_in_float64_is_the_same_arithmetic(
    cp_run_in_float64, status
):
    """A row that cancels can leave cp more than twice as far from float64 as one process by rounding alone;
    where cp run in float64 lies within 1 % of that distance from the exact result, it computes what one
    process computes; a cp error keeps its size in float64 and fails."""
    config = CheckConfig("llama")
    parity = Parity(_rows(grad=3.5e-5), _rows(loss=1.0, logits=1.0, grad=1.0), comm_bytes=0)
    rounding = Rounding(
        cp=_rows(grad=5.8e-5),
        own=_rows(grad=2.3e-5),
        scales=_rows(loss=1.0, logits=1.0, grad=1.0),
        arithmetic=_rows(grad=cp_run_in_float64),
    )
    report = format_report(config, [parity], [rounding])
    assert exit_status(config, [parity], [rounding]) == status, report
    assert rounding.beyond(["grad lm_head"]) == ([] if status == 0 else ["grad lm_head"])
    if status == 0:
        assert (
            "  grad lm_head: cp 5.8e-05, one process 2.3e-05; cp run in float64 4.0e-08 (the same " in report
        )
    else:
        assert report.splitlines()[-1] == "FAIL: 1 of 3 rows differ beyond 1e-05 x scale: grad lm_head"


def test_a_row_whose_distances_are_not_numbers_fails():
    """A NaN distance compares False with every bound, and Rounding.beyond let such a row pass as rounding
    (``cpshard check llama --seq 1``: "loss nan nan pass (fp32 rounding)", exit 0)."""
    config = CheckConfig("llama")
    nan = float("nan")
    parity = Parity(_rows(loss=nan), _rows(loss=nan, logits=1.0, grad=1.0), comm_bytes=0)
    for where in ("cp", "own", "scales"):
        distances = {"cp": _rows(), "own": _rows(), "scales": _rows(loss=1.0, logits=1.0, grad=1.0)}
        distances[where] = {**distances[where], "loss": nan}
        rounding = Rounding(**distances)
        assert rounding.beyond(["loss"]) == ["loss"], where
        assert exit_status(config, [parity], [rounding]) == 1, where


def test_hy_v4_s_hyper_connection_head_at_cp4_is_the_same_arithmetic_in_float64(ranks4):
    """HY-V4's hyper-connection head: at cp 4 on 37 tokens cp's fp32 gradient lay 5.8e-5 of scale from
    float64 and one process's 2.3e-5 (this machine: more than twice); cp run in float64 lies within 1e-7 of
    it, the same arithmetic, so the row is rounding and the check passes."""
    for rounding in ranks4.run(rounding_job, CheckConfig("hy_v4", cp=4, seq=37)):
        cp, own, in_float64 = rounding.relative("grad model.hc_head")
        assert in_float64 < 1e-6 and rounding.same_arithmetic("grad model.hc_head"), (cp, own, in_float64)
        assert rounding.beyond(list(rounding.cp)) == [], rounding


@pytest.mark.parametrize(
    "cp_from_fp32, status, verdict",
    [
        (0.45, 0, "PASS: 3 rows on 1 ranks (1 within bf16 rounding, as the fp32 runs above show)"),
        (0.9, 1, "FAIL: 1 of 3 rows differ beyond 0.05 x scale: logits"),
    ],
    ids=["within-rounding", "beyond"],
)
def test_a_bf16_row_beyond_the_tolerance_is_judged_against_fp32(cp_from_fp32, status, verdict):
    """bf16 rows that fail at 5e-2 get the same second look, against an fp32 run: a router that picks other
    experts in bf16 than in fp32 moves one process's logits as far as cp's."""
    config = CheckConfig("phimoe", dtype="bfloat16")
    parity = Parity(_rows(logits=0.37), _rows(loss=1.0, logits=1.0, grad=1.0), comm_bytes=0)
    rounding = Rounding(
        cp=_rows(logits=cp_from_fp32), own=_rows(logits=0.4), scales=_rows(loss=1.0, logits=1.0, grad=1.0)
    )
    report = format_report(config, [parity], [rounding])
    assert exit_status(config, [parity], [rounding]) == status, report
    lines = report.splitlines()
    assert lines[-1] == verdict, report
    assert lines[3].endswith("pass (bf16 rounding)" if status == 0 else "FAIL"), report
    if status == 0:
        assert "against a run of the same weights and batch in fp32" in report, report


@pytest.mark.ranks  # starts its own ranks
def test_phimoe_in_bf16_at_cp4_passes_as_the_same_arithmetic_in_fp32(capsys):
    """PhiMoE in bf16 at cp 4 on 37 tokens failed 12 of 13 rows at 5e-2 (its logits 0.37 of scale from one
    process's): bf16 rounding flips its router's choices, and one process in bf16 lies as far from an fp32
    run (0.9 of scale) as cp does; cp run in fp32 lies within 1e-6 of it, the same arithmetic."""
    assert main(["check", "phimoe", "--cp", "4", "--seq", "37", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "rows differ beyond 0.05 x scale: comparing cp and one process with a run in fp32" in out, out
    logits = next(line for line in out.splitlines() if line.startswith("  logits: cp "))
    assert logits.endswith("(the same arithmetic)"), out
    assert out.rstrip().splitlines()[-1].endswith("within bf16 rounding, as the fp32 runs above show)"), out


@pytest.mark.ranks  # starts its own ranks
def test_a_check_off_the_kernel_s_chunk_grid_passes_within_fp32_rounding(capsys):
    """qwen3_next at cp 4 on 203 tokens: each rank's 51 start off the Gated DeltaNet kernel's chunk grid, and
    its logits lie 1.7e-5 of scale from one process's (this machine), which is itself 2.3e-5 from a float64
    run; cp 1.3e-5. The check passes, naming the rows it passed as rounding."""
    assert main(["check", "qwen3_next", "--cp", "4", "--seq", "203"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("PASS: 13 rows on 4 ranks"), out
    if "within fp32 rounding" in out:  # the fp32 rows failed on this CPU: the float64 look passed them
        assert "comparing cp and one process with a run in float64" in out and "pass (fp32 rounding)" in out


def test_a_float64_look_that_fails_leaves_the_fp32_verdict(ranks2):
    """The second look raises on the ranks (here: a folder that is gone by then): the check says so in one
    line and keeps the fp32 verdict (None: no second look), rather than losing the table to a traceback."""
    said = []
    assert float64_look(ranks2, CheckConfig("/no/such/folder"), "auto", said.append) is None
    assert len(said) == 1 and said[0].startswith("  the float64 run failed, so the fp32 verdict stands: rank")


@pytest.mark.parametrize("model_type", ["rwkv", "xlstm", "openai-gpt"])
def test_the_plan_on_the_meta_device_takes_a_model_whose_layers_take_no_positions(model_type):
    """The plan derives the layout on a meta-device copy, where nothing runs, so the layers' inputs are
    guessed from their signatures: RWKV's, xLSTM's and OpenAI GPT's blocks take neither rotary pairs nor
    positions, and the check refused them before ranks started ("take none of position_embeddings,
    position_ids"), where the ranks' real derivation serves them (the zoo: exact)."""
    assert f"random {model_type} (small)" in plan(CheckConfig(model_type))


def _unsupported(module, args):
    raise RuntimeError("expected m1 and m2 to have the same dtype")  # as xLSTM's own kernel in bf16


def parity_of_a_model_that_fails_alone():
    """check_parity on a model whose own forward raises, without cp (a pre-hook on its decoder)."""
    model = tiny_model("llama")
    model.model.register_forward_pre_hook(_unsupported)
    batch = tiny_batch(model.config.vocab_size, 2, 8)
    return check_parity(model, batch, make_mesh(cp=2), make_cp_forward(model))


def test_a_model_whose_own_forward_fails_is_named_as_the_model_s(ranks2):
    """transformers 5.25's xLSTM raises in bf16 on 130 tokens in one process, cp or not: the check says that
    the model's own forward without cp raised, and where, rather than leave a bare traceback to blame cp."""
    with pytest.raises(RankError) as caught:
        ranks2.run(parity_of_a_model_that_fails_alone)
    assert {failure.kind for failure in caught.value.failures.values()} == {"OneProcessFailed"}
    said = reported(caught.value)
    first, second = said.splitlines()[:2]
    assert "raised OneProcessFailed: RuntimeError: expected m1 and m2 to have the same dtype" in first, said
    assert second.startswith("that is the model's own forward, in one process without cp"), said
    assert "_unsupported" in said  # the frame that raised


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_a_ring_check_s_second_look_runs_in_float64(ranks2, autocast):
    """The ring computed in fp32 whatever its inputs, so its float64 run (the second look's cp run) mixed
    fp32 and float64 in its backward and raised, and a ring check's verdict stood on the first look alone; it
    now computes float64 inputs in float64: cp run in float64 lies far nearer the exact result than cp in
    fp32 (or under bf16 autocast) on every row (the logits within 1e-2 of that: the same arithmetic; the
    gradients at the float64 runs' floor, about 5e-8 of scale)."""
    config = CheckConfig("llama", seq=16, implementation="ring", autocast=autocast)
    for rounding in ranks2.run(rounding_job, config):
        assert rounding.same_arithmetic("logits"), rounding.relative("logits")
        for row in rounding.cp:
            cp, _, arithmetic = rounding.relative(row)
            assert arithmetic <= 0.2 * cp or cp == 0, (row, rounding.relative(row))
