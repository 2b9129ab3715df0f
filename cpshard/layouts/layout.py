"""What an architecture declares, as data: where the sequence is cut and how attention moves.

Defaults describe the generic transformers decoder: ``model.layers`` of decoder layers that
take rotary ``position_embeddings``, each with a ``self_attn`` that calls its attention
function through transformers' registry with ``q, k, v`` as ``b h s d``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cpshard.spec.notation import Spec


def _specs(*pair: str) -> tuple[Spec, Spec]:
    return Spec(pair[0]), Spec(pair[1])


@dataclass(frozen=True)
class Layout:
    """The cp layout of one architecture. Specs come in (before, after) pairs."""

    name: str
    model_types: tuple[str, ...] = ()
    decoder_layers: str = "model.layers"
    attention: str = "self_attn"
    #: the residual stream, cut once at the first decoder layer (a slice: no communication)
    hidden: tuple[Spec, Spec] = _specs("b s d", "b s@cp d")
    #: per-layer inputs cut the same way at every layer (each layer may get its own rotary pair)
    layer_inputs: tuple[tuple[str, Spec, Spec], ...] = (
        ("position_embeddings", *_specs("b s d", "b s@cp d")),
        ("position_ids", *_specs("b s", "b s@cp")),
    )
    #: q, k and v: sequence-split in, head-split out (one all-to-all each)
    qkv: tuple[Spec, Spec] = _specs("b h s@cp d", "b h@cp s d")
    #: the attention output, as transformers' attention functions return it: back to sequence-split
    attn_output: tuple[Spec, Spec] = _specs("b s h@cp d", "b s@cp h d")
    #: the last module before the LM head: a sequence order other than contiguous is undone on its output
    final_norm: str = "model.norm"
    logits: Spec = Spec("b s@cp v")
    heads: str = "num_attention_heads"
    kv_heads: str = "num_key_value_heads"
    #: the tensor-parallel plan: module paths inside a decoder layer, split column-wise (output
    #: features over ``tp``) or row-wise (input features; the outputs are summed over ``tp``), or
    #: replicated but applied per head (each tp rank's heads add their share to the gradient)
    tensor_parallel: tuple[tuple[str, str], ...] = (
        ("self_attn.q_norm", "per_head"),
        ("self_attn.k_norm", "per_head"),
        ("self_attn.q_proj", "colwise"),
        ("self_attn.k_proj", "colwise"),
        ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"),
        ("mlp.gate_proj", "colwise"),
        ("mlp.up_proj", "colwise"),
        ("mlp.down_proj", "rowwise"),
    )
    #: where the replicated residual stream enters the column-wise layers: their input gradients sum over ``tp``
    tensor_parallel_inputs: tuple[str, ...] = ("self_attn", "mlp")
    #: modules inside a decoder layer whose parameters hold one slice per expert on dim 0 (split over ``ep``)
    experts: tuple[str, ...] = ()

    def for_types(self, name: str, *model_types: str) -> Layout:
        """This layout under another name, registered for ``model_types``."""
        return replace(self, name=name, model_types=model_types)
