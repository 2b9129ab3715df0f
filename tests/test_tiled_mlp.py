"""The MLP a block of tokens at a time under cp: exact against one process, blocks really run (and are
recomputed), and tiles that cannot serve (no positive count, experts in the MLP) are refused."""

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.registry import resolve_layout
from cpshard.tools.memory import LiveTensors
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model

TOLERANCE = 1e-5


#: each model's first MLP projection, whose inputs show the blocks
FIRST_PROJECTION = {"llama": "mlp.gate_proj", "gpt2": "mlp.c_fc", "bamba": "feed_forward.gate_proj"}


def tiled_against_one_process(
    tile: int, forward: dict, batch_options: dict, checkpointing: bool, model_type: str = "llama"
):
    """Largest relative difference of loss, logits and every gradient from one process, and how many times
    the layers' MLP projections ran in the step. The parameters are not the module's own (an optimizer's
    output)."""
    model, twin = (tiny_model(model_type, num_hidden_layers=2) for _ in range(2))
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()
    params = {name: p.detach() * 1.1 for name, p in cpshard.params_of(model).items()}
    batch = tiny_batch(model.config.vocab_size, 2, 15, **batch_options)
    want_loss, want_logits, want = reference(twin, params, batch)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    step = cpshard.value_and_grad(cpshard.make_cp_forward(model, mlp_tile=tile, **forward))
    step(params, batch, mesh)
    runs = []  # the tokens each call of an MLP's first projection took
    for layer in model.get_submodule(resolve_layout(model).decoder_layers):
        projection = layer.get_submodule(FIRST_PROJECTION[model_type])
        projection.register_forward_hook(lambda _, args, __: runs.append(args[0].shape[1]))
    out, grads = step(params, batch, mesh)
    diffs = [((out.loss - want_loss).abs() / want_loss.abs()).item()]
    if out.logits is not None:
        diffs.append(((out.logits.full_tensor() - want_logits).abs().max() / want_logits.abs().max()).item())
    diffs += [((grads[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want]
    return max(diffs), runs


CASES = {  # mlp_tile, make_cp_forward options, batch options, activation checkpointing
    "ulysses": (3, {}, {}, False),
    "ulysses-no-logits-right-pad": (3, dict(logits=False), dict(pad="right"), False),
    "ring-packed": (5, dict(implementation="ring"), dict(packed=True), False),
    "ulysses-checkpointed": (3, {}, {}, True),
    # GPT-2's Conv1D views its input: a block of a batch's positions is strided, and ran into it
    "gpt2": (3, {}, {}, False, "gpt2"),
    # a derived layout's MLP by another name: Bamba's feed_forward (the derived row said 'mlp': none there)
    "bamba": (3, {}, {}, False, "bamba"),
}


@pytest.mark.parametrize("name", CASES)
def test_tiled_mlp_is_exact(ranks2, name):
    tile = CASES[name][0]
    local = 8  # 15 tokens padded to 16 over cp=2 (ring on packed rows: striped, padded to 16 as well)
    for worst, runs in ranks2.run(tiled_against_one_process, *CASES[name]):
        assert worst <= TOLERANCE, name
        assert max(runs) <= tile, f"the MLP ran {max(runs)} tokens at once"
        # every layer's blocks, in the forward and again in the backward's recompute
        assert len(runs) >= 2 * 2 * -(-local // tile) and sum(runs) >= 2 * 2 * local


def refused(model_type: str, tile) -> str:
    model = tiny_model(model_type, attn_implementation="auto")
    with pytest.raises(LayoutError) as caught:
        cpshard.make_cp_forward(model, mlp_tile=tile)
    return str(caught.value)


def test_tiles_that_cannot_serve_are_refused():
    assert "mlp_tile=0 is not a positive number of tokens" in refused("llama", 0)
    assert "mlp_tile=True is not a positive number of tokens" in refused("llama", True)
    assert "mlp_tile tiles dense MLPs; 'mlp' holds the experts ['mlp.experts']" in refused("qwen3_moe", 4)
    assert "layout 'xlm' names none (its decoder has no MLP module per layer)" in refused("xlm", 4)
    # a layout whose mlp row the layers lack: "not every layer has 'mlp'" said neither where nor what to do
    model = tiny_model("bamba")
    with pytest.raises(LayoutError) as caught:
        cpshard.make_cp_forward(model, layout=resolve_layout(model).with_rows(mlp="ffn"), mlp_tile=4)
    error = str(caught.value)
    assert "at the layout's mlp row ('ffn'), which 2 of 2 layers lack (layer 0, a BambaDecoderLayer" in error
    assert "feed_forward (BambaMLP)" in error and "that name in its mlp row and pass it as layout=" in error
    # experts a layout does not name, found in the modules: a derived layout's, and Qwen3-Next's (whose table
    # serves its dense and MoE variants); Qwen3-Next's ran tiled and crashed inside its MoE block at batch 2
    blocks = {"mixtral": "MixtralSparseMoeBlock", "qwen3_next": "Qwen3NextSparseMoeBlock"}
    for model_type, block in blocks.items():
        error = refused(model_type, 4)
        assert "mlp_tile tiles dense MLPs; 'mlp' routes tokens to experts in 2 of 2 layers" in error, error
        assert f"(layer 0's {block} first)" in error, error


def test_outside_a_call_the_mlp_is_its_own():
    model, twin = tiny_model("llama"), tiny_model("llama")
    cpshard.make_cp_forward(model, mlp_tile=2)
    batch = tiny_batch(model.config.vocab_size, 1, 9)
    assert torch.equal(model(**batch).logits, twin(**batch).logits)


def step_peaks(tile: int, seq: int) -> dict:
    """This rank's peak of the tensors one training step allocates, per (layer checkpointing, tiled MLP), on a
    model whose MLP is wide (1,024) against its hidden size (64), so that the MLP's activations dominate."""
    sizes = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=1024, vocab_size=64)
    params = cpshard.params_of(tiny_model("llama", **sizes))
    batch = tiny_batch(64, 1, seq)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    peaks = {}
    for checkpointing in (False, True):
        for tiled in (False, True):
            model = tiny_model("llama", **sizes).train()
            if checkpointing:
                model.activation_checkpointing_enable()
            tiling = dict(mlp_tile=tile) if tiled else {}
            step = cpshard.value_and_grad(cpshard.make_cp_forward(model, logits=False, **tiling))
            step(params, batch, mesh)  # the first call sets up
            with LiveTensors() as live:
                step(params, batch, mesh)
            peaks[checkpointing, tiled] = live.peak
    return peaks


def test_tiling_lowers_the_peak_with_and_without_layer_checkpointing(ranks2):
    """Counted in bytes of live tensors (deterministic), not resident memory: glibc's heap keeps freed
    blocks resident, and that made the tiled MLP under checkpointing look worse than without it."""
    for peaks in ranks2.run(step_peaks, 32, 512):
        assert peaks[False, True] < 0.6 * peaks[False, False]
        assert peaks[True, True] < 0.8 * peaks[True, False]
