"""Mistral: Llama's table. Its sliding window lives in the whole-sequence mask, so it stays exact."""

from cpshard.layouts.llama import LAYOUT as LLAMA

LAYOUT = LLAMA.with_rows(name="mistral", model_types=("mistral",))
