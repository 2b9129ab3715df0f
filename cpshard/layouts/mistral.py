"""Mistral: the generic decoder. Its sliding window lives in the whole-sequence mask, so it stays exact."""

from cpshard.layouts.decoder import LAYOUT as DECODER

LAYOUT = DECODER.for_types("mistral", "mistral")
