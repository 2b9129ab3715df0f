"""Gemma3 (text model): Qwen3's table, with mixed layers and a softcapped head.

Layers alternate sliding and global attention, each with its own rotary pair and its own mask. The
per-layer cut slices whichever pair a layer receives, and each mask is built for the whole sequence,
so both kinds of layer stay exact; softcapped eager attention is the model's own, wrapped. The LM
head softcaps its logits by ``final_logit_softcapping``.
"""

from cpshard.layouts.qwen3 import LAYOUT as QWEN3

LAYOUT = QWEN3.with_rows(
    name="gemma3",
    model_types=("gemma3_text",),
    head_transforms=("final_logit_softcapping",),
)
