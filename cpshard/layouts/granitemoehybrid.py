"""Granite 4.0 hybrid (granitemoehybrid): decoder layers of Mamba2 (``mamba``) or attention (``self_attn``),
each followed by a sparse MoE with a shared expert.

The Mamba2 layers are served as in Nemotron-H's table (:mod:`cpshard.layouts.nemotron_h`): state passing
of the SSD scan's state, a halo for its convolution. The attention layers are Llama's, with no rotary
embedding (Granite 4.0 uses none), and Granite divides its logits by ``logits_scaling``. Tensor
parallelism is not served beside the recurrent layers yet: the plan is empty.
"""

from dataclasses import replace

from cpshard.layouts.llama import LAYOUT as LLAMA
from cpshard.layouts.nemotron_h import MAMBA2

LAYOUT = replace(
    LLAMA,
    name="granitemoehybrid",
    model_types=("granitemoehybrid",),
    layer_inputs=(),
    head_transforms=("logits_scaling",),
    tensor_parallel={},
    tensor_parallel_inputs=(),
    mlp=None,
    recurrent=(replace(MAMBA2, module="mamba"),),
)
