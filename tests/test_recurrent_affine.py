"""State passing in one process: slices summarised from a zero state, folded and corrected, match one
call of the same kernel on the whole sequence (outputs, final state, every gradient)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from cpshard.recurrent.affine import (
    correct_outputs,
    delta_rule_summary,
    fold_states,
    ssd_summary,
)

KERNELS = {"gated_delta": torch_chunk_gated_delta_rule, "kda": chunk_kimi_delta_attention}
#: unequal slices; 128 + 172 puts two kernel chunks of 64 in each, the last split has a one-token slice
SPLITS = [(128, 172), (100, 64, 136), (1, 127, 64, 108)]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def inputs(kind, dk, dv, heads=3, k_heads=None, batch=2, length=300, dtype=torch.float32, seed=0):
    """Leaf tensors with the model's conventions, decays mild enough that states carry across slices."""
    gen = torch.Generator().manual_seed(seed)
    k_heads = k_heads or heads

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    x = {
        "query": rand(batch, length, k_heads, dk),
        "key": rand(batch, length, k_heads, dk),
        "value": rand(batch, length, heads, dv),
        "initial_state": rand(batch, heads, dk, dv),
    }
    # a decay per head (gated delta) or per head and key channel (KDA)
    decay_shape = (batch, length, heads) if kind == "gated_delta" else (batch, length, heads, dk)
    x |= {"g": -0.05 * F.softplus(rand(*decay_shape)), "beta": rand(batch, length, heads).sigmoid()}
    return {name: t.to(dtype).requires_grad_() for name, t in x.items()}


def whole(kind, x):
    """One call on the whole sequence from the given state: the reference."""
    tokens = {name: t for name, t in x.items() if name != "initial_state"}
    return KERNELS[kind](
        **tokens, initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True
    )


def summarise(kind, piece):
    return delta_rule_summary(KERNELS[kind], **piece, use_qk_l2norm_in_kernel=True)


def split_tokens(x, lengths):
    """Per slice, the per-token inputs of its contiguous tokens."""
    tokens = {name: t.split(lengths, dim=1) for name, t in x.items() if name != "initial_state"}
    return [{name: pieces[r] for name, pieces in tokens.items()} for r in range(len(lengths))]


def sliced(kind, x, lengths):
    """State passing: summaries per slice, the fold, the corrections; (outputs, final state, summaries)."""
    summaries = [summarise(kind, piece) for piece in split_tokens(x, lengths)]
    states = fold_states(
        [s.transition for s in summaries], [s.state_local for s in summaries], x["initial_state"]
    )
    outputs = [
        correct_outputs(s.o_zero, s.q_eff, state_in, x["query"].dtype)
        for s, state_in in zip(summaries, states)
    ]
    return torch.cat(outputs, dim=1), states[-1], summaries


def gradients(x, outputs, final_state, seed=1):
    """Gradients of a random scalar of both outputs and final state, w.r.t. every input."""
    gen = torch.Generator().manual_seed(seed)
    loss = (outputs.float() * torch.randn(outputs.shape, generator=gen)).sum()
    loss = loss + (final_state.float() * torch.randn(final_state.shape, generator=gen)).sum()
    return dict(zip(x, torch.autograd.grad(loss, list(x.values()))))


def check_sliced_matches_whole(kind, x, lengths, **tolerance):
    outputs, final_state = whole(kind, x)
    got_outputs, got_final, summaries = sliced(kind, x, lengths)
    torch.testing.assert_close(got_outputs, outputs, **tolerance)
    torch.testing.assert_close(got_final, final_state, **tolerance)
    expected, got = gradients(x, outputs, final_state), gradients(x, got_outputs, got_final)
    for name in x:
        torch.testing.assert_close(got[name], expected[name], **tolerance, msg=lambda m, n=name: f"{n}: {m}")
    return outputs, summaries


@pytest.mark.parametrize("lengths", SPLITS, ids=lambda s: "+".join(map(str, s)))
@pytest.mark.parametrize("dk, dv", [(16, 16), (16, 24)])
@pytest.mark.parametrize("kind", ["gated_delta", "kda"])
def test_slices_folded_and_corrected_are_the_whole_sequence(kind, dk, dv, lengths):
    x = inputs(kind, dk, dv)
    outputs, summaries = check_sliced_matches_whole(kind, x, lengths, **TOLERANCE)
    # not vacuous: the incoming states matter to the outputs of the later slices
    uncorrected = torch.cat([s.o_zero for s in summaries], dim=1)
    assert (uncorrected[:, lengths[0] :] - outputs[:, lengths[0] :]).abs().max() > 1e-2


def test_grouped_value_heads_of_gated_delta():
    """qwen3_next's kernel repeats each q / k head over several value heads; the state is per value head."""
    x = inputs("gated_delta", 16, 16, heads=3, k_heads=1)
    check_sliced_matches_whole("gated_delta", x, [128, 172], **TOLERANCE)


@pytest.mark.parametrize("kind", ["gated_delta", "kda"])
def test_bf16_inputs_give_bf16_outputs_rounded_once(kind):
    """Summaries and the fold stay fp32 whatever the inputs; outputs come back in the kernel's dtype."""
    x = inputs(kind, 16, 16, dtype=torch.bfloat16)
    reference = {name: t.detach().float() for name, t in x.items()}
    got_outputs, got_final, _ = sliced(kind, x, [100, 64, 136])
    outputs, final_state = whole(kind, reference)
    assert got_outputs.dtype == torch.bfloat16 and got_final.dtype == torch.float32
    torch.testing.assert_close(got_outputs, outputs.to(torch.bfloat16), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got_final, final_state, rtol=1e-5, atol=1e-5)


def ssd_inputs(heads=4, groups=2, width=8, states=6, batch=2, length=300, seed=0) -> dict:
    """Mamba2's scan inputs: x ``[B, T, H, P]``, raw dt ``[B, T, H]``, B and C per group, and the state."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    x = {
        "hidden_states": rand(batch, length, heads, width),
        "dt": rand(batch, length, heads) - 2,
        "B": rand(batch, length, groups, states),
        "C": rand(batch, length, groups, states),
        "initial_states": rand(batch, heads, width, states),
    }
    return {name: t.requires_grad_() for name, t in x.items()}


def ssd_kwargs(heads=4) -> dict:
    """The model's own arguments, as NemotronH's mixer passes them (A and D per head, a time-step floor)."""
    gen = torch.Generator().manual_seed(9)
    return {
        "A": -torch.rand(heads, generator=gen) - 0.5,
        "D": torch.randn(heads, generator=gen),
        "dt_bias": torch.randn(heads, generator=gen),
        "dt_softplus": True,
        "dt_limit": (0.0, float("inf")),
    }


@pytest.mark.parametrize("lengths", SPLITS, ids=lambda s: "+".join(map(str, s)))
def test_ssd_slices_folded_and_corrected_are_the_whole_sequence(lengths):
    x, kwargs, chunk = ssd_inputs(), ssd_kwargs(), 64
    tokens = {name: t for name, t in x.items() if name != "initial_states"}
    outputs, final = mamba2_chunk_scan(
        **tokens, chunk_size=chunk, initial_states=x["initial_states"], return_final_states=True, **kwargs
    )
    pieces = [dict(zip(tokens, p)) for p in zip(*(t.split(lengths, dim=1) for t in tokens.values()))]
    summaries = [ssd_summary(mamba2_chunk_scan, **piece, chunk_size=chunk, **kwargs) for piece in pieces]
    states = fold_states(
        [s.transition for s in summaries],
        [s.state_local for s in summaries],
        x["initial_states"].transpose(-1, -2),
    )
    got = torch.cat(
        [correct_outputs(s.o_zero, s.q_eff, state, torch.float32) for s, state in zip(summaries, states)], 1
    )
    got_final = states[-1].transpose(-1, -2)
    torch.testing.assert_close(got, outputs, **TOLERANCE)
    torch.testing.assert_close(got_final, final, **TOLERANCE)
    expected, sliced_grads = gradients(x, outputs, final), gradients(x, got, got_final)
    for name in x:
        torch.testing.assert_close(sliced_grads[name], expected[name], **TOLERANCE)
    uncorrected = torch.cat([s.o_zero for s in summaries], dim=1)  # the incoming states matter
    assert (uncorrected[:, lengths[0] :] - outputs[:, lengths[0] :]).abs().max() > 1e-2
