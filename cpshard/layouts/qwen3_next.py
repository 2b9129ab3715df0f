"""Qwen3-Next and Qwen3.5 (text, dense and MoE): Gated DeltaNet layers beside gated attention.

Three of every four layers hold ``linear_attn``, a Gated DeltaNet: a short causal convolution, then a
delta-rule recurrence whose state ``[b, h, k, v]`` cp passes between the ranks instead of the sequence
(each rank's slice from a zero state, one fp32 summary per rank, the convolution's halo from the rank
before: :mod:`cpshard.recurrent`). The others hold ``self_attn`` as Llama's table moves it (its output
gate and partial rotary are per token). The recurrence runs in contiguous order, so every call does.

Tensor parallelism splits the attention layers' heads (each head's query and output gate stay together:
the model lays them out head by head) and the dense MLP's features, as Qwen3's plan does; the Gated
DeltaNet layers and a MoE run whole on every tp rank.
"""

from dataclasses import replace

from cpshard.layouts.layout import Recurrent, specs
from cpshard.layouts.llama import LAYOUT as LLAMA
from cpshard.layouts.qwen3 import LAYOUT as QWEN3

LAYOUT = replace(
    LLAMA,
    name="qwen3_next",
    model_types=("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"),
    layer_inputs=(
        ("position_embeddings", *specs("b s x2", "b s@cp x2")),
        ("position_ids", *specs("b s", "b s@cp")),
    ),
    tensor_parallel=QWEN3.tensor_parallel,
    recurrent=(Recurrent("linear_attn", kernel="chunk_gated_delta_rule", conv="causal_conv1d_fn"),),
)
