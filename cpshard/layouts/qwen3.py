"""Qwen3: the generic decoder. q_norm and k_norm act per head on the local slice, before the all-to-all."""

from cpshard.layouts.decoder import LAYOUT as DECODER

LAYOUT = DECODER.for_types("qwen3", "qwen3")
