"""Qwen3: Llama's table, and per-head q and k norms that act on the local slice before the all-to-all.

Under tensor parallelism the norms stay whole on every rank, but each rank's heads add their share
of the norms' gradient.
"""

from cpshard.layouts.llama import LAYOUT as LLAMA

LAYOUT = LLAMA.with_rows(
    name="qwen3",
    model_types=("qwen3",),
    tensor_parallel={"self_attn.q_norm": "per_head", "self_attn.k_norm": "per_head"},
)
