"""Llama, the whole table: what context parallelism does to a Llama decoder.

The sequence is cut once, before the first layer (the embeddings, the rotary pair and the causal
mask are computed on the whole sequence first); each layer slices its rotary pair. Attention
moves q, k and v by one all-to-all (the three together) from sequence-split to head-split, runs
the model's own attention function on whole sequences, and one all-to-all brings its output back.
The head is a plain projection. Tensor parallelism splits q/k/v and gate/up by columns, o and down by rows.
"""

from cpshard.layouts.layout import Layout, specs
from cpshard.spec.notation import Spec

# fmt: off
# a table: related rows share a line (the formatter would give each row its own)
LAYOUT = Layout(
    name="llama", model_types=("llama",),
    decoder="model", decoder_layers="model.layers", attention="self_attn", final_norm="model.norm",
    heads="num_attention_heads", kv_heads="num_key_value_heads", mlp_width="intermediate_size",
    hidden=specs("b s d", "b s@cp d"),  # once, before layer 0
    layer_inputs=(  # each layer's rotary pair and positions
        ("position_embeddings", *specs("b s d", "b s@cp d")),
        ("position_ids", *specs("b s", "b s@cp")),
    ),
    qkv=specs("b h s@cp d", "b h@cp s d"), attn_output=specs("b s h@cp d", "b s@cp h d"),
    logits=Spec("b s@cp v"), head_transforms=(),
    tensor_parallel={
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
    },
    tensor_parallel_inputs=("self_attn", "mlp"), experts=(), per_head_params=(), mlp="mlp",
)
# fmt: on
