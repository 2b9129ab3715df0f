"""Nemotron-H and Nemotron 3 (nemotron_h): every decoder layer holds one ``mixer``, which is a Mamba2 layer,
attention, an MLP or a sparse MoE, as the config's pattern says.

A Mamba2 mixer runs a short causal convolution, then the SSD scan, whose state ``[b, h, p, n]`` cp passes
between the ranks instead of the sequence: each rank scans its slice from a zero state with the model's
own kernel, one fp32 summary per rank (the state and one decay per head) is all-gathered, the convolution
takes its halo from the rank before (:mod:`cpshard.recurrent`). Attention mixers are Ulysses' or the
ring's as in Llama's table (no rotary embedding: the layers take ``position_ids`` only). MLP and MoE mixers
work token by token (``pointwise``). The scan runs in contiguous order, so every call does.

Tensor parallelism splits the attention mixers' heads and the MLP mixers' features as Llama's plan does;
the Mamba2 and MoE mixers run whole on every tp rank (their plan rows name no module of theirs).
"""

from dataclasses import replace

from cpshard.layouts.layout import Recurrent, specs
from cpshard.layouts.llama import LAYOUT as LLAMA

#: Mamba2's scan and convolution slots, as transformers 5.25's Mamba2 mixers call them
MAMBA2 = Recurrent("mixer", kernel="mamba_chunk_scan_combined", conv="causal_conv1d_fn", decay="scalar")

# fmt: off
# a table: related rows share a line (the formatter would give each row its own)
LAYOUT = replace(
    LLAMA,
    name="nemotron_h", model_types=("nemotron_h",),
    attention="mixer", final_norm="model.norm_f",
    layer_inputs=(("position_ids", *specs("b s", "b s@cp")),),
    tensor_parallel={
        "mixer.q_proj": "colwise", "mixer.k_proj": "colwise", "mixer.v_proj": "colwise",
        "mixer.o_proj": "rowwise",
        "mixer.up_proj": "colwise", "mixer.down_proj": "rowwise",
    },
    tensor_parallel_inputs=("mixer",), mlp=None,
    recurrent=(MAMBA2,), pointwise=("NemotronHMLP", "NemotronHMoE"),
)
# fmt: on
