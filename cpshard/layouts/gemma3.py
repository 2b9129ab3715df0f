"""Gemma3 (text model): layers alternate sliding and global attention, each with its own rotary pair
and its own mask. The generic per-layer cut slices whichever pair a layer receives, and each mask is
built for the whole sequence, so both kinds of layer stay exact; softcapped eager attention is the
model's own, wrapped.
"""

from cpshard.layouts.decoder import LAYOUT as DECODER

LAYOUT = DECODER.for_types("gemma3", "gemma3_text")
