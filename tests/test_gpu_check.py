"""benchmarks/gpu_check.py on the CPU, fp32, at its quick sizes: the numerical parts of each check (the ring's
block over two key halves against one flash call, cp=1 steps against the plain model and compiled layers
against eager, a delta-rule kernel against transformers' torch reference) agree where they should and fail
where they should not; without a CUDA device the script refuses ``--device cuda`` clearly. The GPU's own
numbers (its kernels, inductor on CUDA, fla) come only from a run on one."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

CPU, QUICK = torch.device("cpu"), gpu_check.SIZES["quick"]


def _verdicts(rows) -> dict[str, str]:
    return {row.name: row.verdict for row in rows}


def test_ring_block_over_two_halves_is_one_flash_call():
    rows = gpu_check.ring_block(CPU, torch.float32, QUICK)
    assert _verdicts(rows) == {
        "ring block: output vs one flash call": "PASS",
        "ring block: time / one flash call": "INFO",  # tiny sizes time overheads: no target
    }
    assert rows[0].value < 1e-5
    assert "fused flash kernel, 10 tiles" in rows[1].note  # CPU: torch's kernel on the causal tiles of 4 x 4


def _shifted(kernel):
    """``kernel`` with its outputs 1% off."""

    def run(*args, **kwargs):
        out, state = kernel(*args, **kwargs)
        return out * 1.01, state

    return run


def test_delta_rule_rows_compare_a_kernel_with_the_torch_reference():
    # transformers' token-by-token recurrence stands in for fla: the same numbers by another algorithm
    rows = gpu_check.delta_rule(CPU, torch.float32, QUICK, torch_recurrent_gated_delta_rule)
    rows += gpu_check.slice_summary(CPU, torch.float32, QUICK, torch_recurrent_gated_delta_rule)
    assert set(_verdicts(rows).values()) == {"PASS"}, gpu_check.report(rows)
    off = gpu_check.delta_rule(CPU, torch.float32, QUICK, _shifted(torch_recurrent_gated_delta_rule))
    assert [row.verdict for row in off] == ["FAIL", "PASS"]  # the outputs are off, the state is not


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cp1_step_matches_the_plain_model(dtype):
    # bf16 also runs the step on fp32 copies of the weights: the plain model's distance from it is the target
    with gpu_check.one_process(CPU) as mesh:
        rows = gpu_check.cp1_parity(CPU, dtype, QUICK, mesh)
    assert set(_verdicts(rows).values()) == {"PASS"}, gpu_check.report(rows)


def test_a_cp1_step_under_bf16_autocast_matches_the_plain_model_s():
    # the target: bf16's tolerance, or twice the plain model's own distance from the step without autocast
    with gpu_check.one_process(CPU) as mesh:
        rows = gpu_check.autocast_parity(CPU, QUICK, mesh)
    assert set(_verdicts(rows).values()) == {"PASS"}, gpu_check.report(rows)


def test_compiled_layers_match_eager():
    # aot_eager: the tracing cpshard's compiled layers go through, at a fraction of inductor's compile time
    with gpu_check.one_process(CPU) as mesh:
        rows = gpu_check.compiled_layers(CPU, torch.float32, QUICK, mesh, compile="aot_eager")
    assert [row.verdict for row in rows] == ["PASS", "PASS", "INFO", "INFO"], gpu_check.report(rows)


def test_an_error_is_a_failed_row():
    def broken(*_):
        raise RuntimeError("no kernel image\nmore")

    rows = gpu_check.guarded("ring block", broken) + [gpu_check.Row("skipped one", None, None, "", "SKIP")]
    assert [row.verdict for row in rows] == ["FAIL", "SKIP"]
    assert "RuntimeError: no kernel image" in gpu_check.report(rows)
    assert "more" not in gpu_check.report(rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_refuses_cuda_without_a_device(capsys):
    with pytest.raises(SystemExit) as exit:
        gpu_check.main(["--device", "cuda"])
    assert exit.value.code == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_a_cp2_step_on_one_device_matches_the_plain_model(monkeypatch):
    # on the CPU, two gloo ranks: the check's own arithmetic (a GPU run shows the device's tensors meeting);
    # the ranks import the script by its name, as they do when it runs as __main__ from its folder
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)
    rows = gpu_check.cp2_parity(CPU, QUICK)
    assert [row.verdict for row in rows] == ["PASS", "PASS", "PASS"], gpu_check.report(rows)
    assert rows[1].value < 1e-5
