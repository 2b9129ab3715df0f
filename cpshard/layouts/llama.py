"""Llama: the generic decoder, cut before the first layer; q, k, v and the output move by all-to-all."""

from cpshard.layouts.decoder import LAYOUT as DECODER

LAYOUT = DECODER.for_types("llama", "llama")
