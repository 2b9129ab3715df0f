"""The cut: where the sequence is split and put back, on decoders that differ from Llama's shape.

GPT-2 reshapes its final hidden states to the input's length (the rows each rank holds travel in a tensor
of that length to the head); BERT is post-norm (its last layer, whose output is a tuple, gives the final
hidden states); Gemma4 hands each layer its per-layer input by position. Each is exact against one
process under Ulysses and under ring's head-tail order, with and without logits. (Gemma4 runs Ulysses
here: under ring its small per-layer gate gradients differ by 1.4e-6, just beyond 1e-5 of their scale: the
ring's blockwise sums rounding at the edge of the 1e-5 tolerance.)

DeepSeek-V4 (hyper-connections, ``b s n d``) and Gemma 3n (AltUp, ``n b s d``) keep several copies of each
token in their residual stream: the derived spec cuts its sequence dim wherever it sits; exact at cp 2 and 4
under Ulysses, plain and left-padded.

Dory enters its layers more than once per forward (looped): the stream is cut where it comes in whole, once,
and later passes take the slice on; exact at cp 2 and 4, Ulysses and ring, plain and left-padded.

HRM (hrm_text) runs two stacks of layers in cycles from its own loop, whole-sequence states beside them: cut
where the sequence enters its decoder, every pass of both stacks holds the rank's slice; exact at cp 2 and 4,
Ulysses and ring, plain and left-padded; compile and head-tail order refused.
"""

from functools import partial

import pytest
import torch

import cpshard
from cpshard.call import split_call
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model

CASES = [
    ("gpt2", "ring", True),
    ("gpt2", "ulysses", False),
    ("bert", "ring", True),
    ("gemma4_text", "ulysses", True),
]


def exact_rows(model_type: str, implementation: str, logits: bool) -> list[str]:
    mesh = cpshard.make_mesh(cp=2)
    model = tiny_model(model_type, attn_implementation="auto")
    forward = cpshard.make_cp_forward(model, implementation=implementation, logits=logits)
    batch = tiny_batch(model.config.vocab_size, 2, 11, pad="left")
    return failing_rows([check_parity(model, batch, mesh, forward)])


@pytest.mark.parametrize("model_type, implementation, logits", CASES)
def test_other_decoder_shapes_are_exact(ranks2, model_type, implementation, logits):
    assert ranks2.run(exact_rows, model_type, implementation, logits) == [[], []]


#: residual streams of several copies per token, their sequence dim where the model keeps it; each model's
#: mixing across copies is per token. DeepSeek-V4 as the tiny config has it: a sliding layer (a window shorter
#: than the batch, sinks) and its two compressed ones (windows of 3 and 4 tokens pooled into keys, across the
#: ranks: :mod:`cpshard.attention.sparse`); Gemma 3n's AltUp with sliding and full layers, the last two
#: reusing the keys of earlier ones, and the activation sparsity of its first MLP.
STREAMS = {
    "deepseek_v4": ("b s@cp n d", {}),
    "gemma3n_text": (
        "n b s@cp d",
        dict(
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=4,
            num_kv_shared_layers=2,
            activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        ),
    ),
}


def stream_rows(model_type: str) -> tuple[str, list[str]]:
    """The derived stream's spec, and the failing rows on a plain and a left-padded batch of 11 tokens."""
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    model = tiny_model(model_type, attn_implementation="auto", **STREAMS[model_type][1])
    forward = cpshard.make_cp_forward(model, implementation="ulysses")
    batches = [tiny_batch(model.config.vocab_size, 2, 11, pad=pad) for pad in (None, "left")]
    return str(forward.layout.hidden[1]), failing_rows(
        [check_parity(model, b, mesh, forward) for b in batches]
    )


@pytest.mark.parametrize("model_type", sorted(STREAMS))
def test_streams_of_copies_are_cut_where_their_sequence_sits(ranks2, ranks4, model_type):
    want = (STREAMS[model_type][0], [])
    assert ranks2.run(stream_rows, model_type) == [want] * 2
    assert ranks4.run(stream_rows, model_type) == [want] * 4


#: Dory's looped decoders: the zoo's (its tiny sections overlap: both layers run twice), input, recurrent
#: (three passes, a sliding layer) and output layers, and a recurrent section from layer 0 (the norm of the
#: embeddings, added back before every pass, meets the stream before any layer does)
LOOPED = {
    "overlapping": {},
    "sections": dict(
        num_hidden_layers=3,
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
        n_recurrent_loops=3,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=4,
    ),
    "from layer 0": dict(num_hidden_layers=3, n_input_layers=0, n_recurrent_layers=2, n_output_layers=1),
}


def looped_rows(cp: int) -> dict:
    """Per (decoder, implementation, padding): the rows (loss, logits, every gradient) that differ from one
    process on two rows of 11 tokens (not a multiple of ``cp``)."""
    mesh, failing = cpshard.make_mesh(cp=cp), {}
    for name, config in LOOPED.items():
        model = tiny_model("dory", attn_implementation="auto", **config)
        for implementation in ("ulysses", "ring"):
            forward = cpshard.make_cp_forward(model, implementation=implementation)
            for pad in (None, "left"):
                batch = tiny_batch(model.config.vocab_size, 2, 11, pad=pad)
                parity = check_parity(model, batch, mesh, forward)
                failing[name, implementation, pad] = failing_rows([parity])
    return failing


@pytest.mark.parametrize("ranks", ["ranks2", "ranks4"])
def test_looped_layers_are_exact(request, ranks):
    for failing in request.getfixturevalue(ranks).run(looped_rows, int(ranks[-1])):
        assert not any(failing.values()), failing


def head_tail_refusal() -> str:
    model = tiny_model("dory", attn_implementation="auto")
    forward = cpshard.make_cp_forward(model, implementation="ring", sequence_order="head_tail")
    with pytest.raises(ValueError) as info:
        forward(cpshard.params_of(model), tiny_batch(model.config.vocab_size, 2, 11), cpshard.make_mesh(cp=2))
    return str(info.value)


def test_looped_layers_refuse_an_order_undone_mid_stream(ranks2):
    for message in ranks2.run(head_tail_refusal):
        assert "more than once per forward" in message and "model.norm" in message, message


def hrm_rows(cp: int) -> dict:
    """Per (implementation, padding): the rows (loss, logits, every gradient) in which HRM's text model (two
    stacks of layers run in cycles from its own loop, cut where the sequence enters it) differs from one
    process on two rows of 11 tokens (not a multiple of ``cp``)."""
    mesh, failing, lengths = cpshard.make_mesh(cp=cp), {}, set()
    model = tiny_model("hrm_text", attn_implementation="auto")
    stacks = (model.model.L_module.layers[0], model.model.H_module.layers[0])
    seen = [s.register_forward_pre_hook(partial(_held_length, lengths)) for s in stacks]
    for implementation in ("ulysses", "ring"):
        forward = cpshard.make_cp_forward(model, implementation=implementation)
        assert forward.layout.cut_at_entry and forward.layout.final_norm == "model.H_module.final_norm"
        for pad in (None, "left"):
            batch = tiny_batch(model.config.vocab_size, 2, 11, pad=pad)
            failing[implementation, pad] = failing_rows([check_parity(model, batch, mesh, forward)])
    for handle in seen:
        handle.remove()
    assert lengths and all(held == share for held, share in lengths), lengths
    return failing


def _held_length(lengths: set, layer, args) -> None:
    """Under a cp call, the length a stack's layer receives and the rank's share of the call's sequence: in
    every pass of both stacks they agree (the cut at the decoder's entry left nothing whole)."""
    call = split_call()
    if call is not None:
        lengths.add((args[0].shape[1], call.padded_length // call.cp_size))


@pytest.mark.parametrize("ranks", ["ranks2", "ranks4"])
def test_stacks_run_in_cycles_are_exact_cut_at_the_decoders_entry(request, ranks):
    for failing in request.getfixturevalue(ranks).run(hrm_rows, int(ranks[-1])):
        assert not any(failing.values()), failing


def hrm_refusals() -> list[str]:
    """What cp does not serve beside HRM's entry cut yet, each a ValueError on every rank: a compiled layer
    (its call resolved by the layers' cut hooks, not installed), an order other than contiguous, and a rope
    type that rescales by the longest position a call sees (a slice's is not the whole sequence's)."""
    model, mesh = tiny_model("hrm_text", attn_implementation="auto"), cpshard.make_mesh(cp=2)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    rescaled = tiny_model("hrm_text", attn_implementation="auto", rope_parameters=dynamic)
    batch, found = tiny_batch(model.config.vocab_size, 2, 11), []
    attempts = [
        (model, dict(compile=True)),
        (model, dict(implementation="ring", sequence_order="head_tail")),
        (rescaled, {}),
    ]
    for which, options in attempts:
        with pytest.raises(ValueError) as info:
            cpshard.make_cp_forward(which, **options)(cpshard.params_of(which), batch, mesh)
        found.append(str(info.value))
    return found


def test_stacks_run_in_cycles_refuse_what_the_entry_cut_does_not_serve(ranks2):
    for compiled, ordered, rescaled in ranks2.run(hrm_refusals):
        assert "cut where the sequence enters it (model)" in compiled, compiled
        assert "sequence_order='head_tail'" in ordered and "where it enters the decoder (model)" in ordered
        assert "rope type 'dynamic' rescales its rotary pair" in rescaled, rescaled


def rotary_pairs_seen(changed_in_place: bool) -> list[list[bool]]:
    """For each layer after the first, whether its cos and sin are the first layer's tensors (a 3-layer
    Llama, left-padded batch of 11 tokens), and whether the call stays exact; ``changed_in_place``: the
    first layer scales its rotary pair in place and back (a model's own business), bumping its version."""
    mesh = cpshard.make_mesh(cp=2)
    model = tiny_model("llama", num_hidden_layers=3)
    forward = cpshard.make_cp_forward(model)
    seen = []

    def record(layer, args, kwargs):
        pair = kwargs["position_embeddings"]
        seen.append(pair)
        if changed_in_place and layer is model.model.layers[0] and split_call() is not None:
            for whole in rotary_whole:
                whole.mul_(2).div_(2)

    rotary_whole = []
    model.model.rotary_emb.register_forward_hook(lambda module, args, out: rotary_whole.extend(out))
    for layer in model.model.layers:
        layer.register_forward_pre_hook(record, with_kwargs=True)
    batch = tiny_batch(model.config.vocab_size, 2, 11, pad="left")
    assert failing_rows([check_parity(model, batch, mesh, forward)]) == []
    cut = seen[len(model.model.layers) :]  # after one process's: the cp call's, half the sequence each
    assert all(pair[0].shape[1] == 6 for pair in cut)
    return [[a is b for a, b in zip(cut[0], pair)] for pair in cut[1:]]


def test_layers_share_one_cut_of_the_rotary_pair(ranks2):
    """Transformers hands every layer the same rotary pair; each layer takes the same cut of it (one copy,
    kept once for the backward, not a copy per layer), and a pair changed in place is cut anew."""
    assert ranks2.run(rotary_pairs_seen, False) == [[[True, True]] * 2] * 2
    assert ranks2.run(rotary_pairs_seen, True) == [[[False, False]] * 2] * 2
