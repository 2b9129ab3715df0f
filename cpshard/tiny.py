"""Small random transformers models built from configs: for the demo, ``cpshard check`` and tests.

Nothing is downloaded: the config is transformers' default for the model type, shrunk.
Weights are drawn with a larger spread than transformers' default, so that logits and
gradients are of order one and parity tolerances mean something.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1 << 16,
    initializer_range=0.15,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(model_type: str, **overrides):
    """transformers' config for ``model_type`` at the sizes of :data:`SMALL`, with ``overrides``."""
    try:
        return AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    except ValueError as error:
        raise ValueError(f"unknown model type {model_type!r}: {error}") from None


def tiny_model(model_type: str, seed: int = 0, attn_implementation: str = "sdpa", dtype=torch.float32, **overrides):
    """A random causal LM of ``model_type``, the same on every process for the same seed."""
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype)
