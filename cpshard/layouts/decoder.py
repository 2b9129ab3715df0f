"""The generic transformers decoder: Llama's table (:mod:`cpshard.layouts.llama`, every row written
out there) with every head transform cpshard knows, each applied only where the config sets it.

Serves a causal LM whose decoder ``model`` holds ``model.layers`` of decoder layers, each with a
``self_attn`` that calls attention through transformers' registry with ``q, k, v`` as ``b h s d``.
Layouts derived from a model (:mod:`cpshard.layouts.derive`) start from this table.
"""

from cpshard.layouts.layout import HEAD_TRANSFORMS
from cpshard.layouts.llama import LAYOUT as LLAMA

LAYOUT = LLAMA.with_rows(
    name="decoder",
    model_types=(),
    # Granite divides its logits, Gemma2 softcaps them
    head_transforms=HEAD_TRANSFORMS,
)
