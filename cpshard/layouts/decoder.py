"""The generic transformers decoder, row by row.

Serves a causal LM whose decoder ``model`` holds ``model.layers`` of decoder layers, each with a
``self_attn`` that calls attention through transformers' registry with ``q, k, v`` as ``b h s d``.
Layouts derived from a model (:mod:`cpshard.layouts.derive`) start from this table.
"""

from cpshard.layouts.layout import HEAD_TRANSFORMS, Layout, specs
from cpshard.spec.notation import Spec

LAYOUT = Layout(
    name="decoder",
    decoder="model",
    decoder_layers="model.layers",
    attention="self_attn",
    final_norm="model.norm",
    heads="num_attention_heads",
    kv_heads="num_key_value_heads",
    mlp_width="intermediate_size",
    # everything before the first layer (embeddings, rotary, masks) runs on the whole sequence
    hidden=specs("b s d", "b s@cp d"),
    layer_inputs=(
        ("position_embeddings", *specs("b s d", "b s@cp d")),
        ("position_ids", *specs("b s", "b s@cp")),
    ),
    qkv=specs("b h s@cp d", "b h@cp s d"),
    attn_output=specs("b s h@cp d", "b s@cp h d"),
    logits=Spec("b s@cp v"),
    # Granite divides its logits, Gemma2 softcaps them; each applies only where the config sets it
    head_transforms=HEAD_TRANSFORMS,
    tensor_parallel={
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    },
    tensor_parallel_inputs=("self_attn", "mlp"),
)
