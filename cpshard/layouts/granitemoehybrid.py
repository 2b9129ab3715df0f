"""Granite 4.0 hybrid (granitemoehybrid): decoder layers of Mamba2 (``mamba``) or attention (``self_attn``),
each followed by a sparse MoE with a shared expert.

The Mamba2 layers are served as in Nemotron-H's table (:mod:`cpshard.layouts.nemotron_h`): state passing
of the SSD scan's state, a halo for its convolution. The attention layers are Llama's: Granite 4.0 uses no
rotary embedding, and a config with ``position_embedding_type="rope"`` hands every layer a rotary pair,
cut as Llama's (an input a layer does not get is not cut). Granite divides its logits by
``logits_scaling``. Tensor parallelism splits the attention layers' heads; the Mamba2 layers and the MoE run
whole on every tp rank.
"""

from dataclasses import replace

from cpshard.layouts.llama import LAYOUT as LLAMA
from cpshard.layouts.nemotron_h import MAMBA2

LAYOUT = replace(
    LLAMA,
    name="granitemoehybrid",
    model_types=("granitemoehybrid",),
    head_transforms=("logits_scaling",),
    tensor_parallel={
        path: style for path, style in LLAMA.tensor_parallel.items() if path.startswith("self_attn.")
    },
    tensor_parallel_inputs=("self_attn",),
    mlp=None,
    recurrent=(replace(MAMBA2, module="mamba"),),
)
