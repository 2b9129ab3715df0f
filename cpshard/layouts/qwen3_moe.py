"""Qwen3-MoE: the generic decoder for attention; the sparse layers' experts split over ``ep``.

Attention is Qwen3's (q_norm and k_norm per head, before the all-to-all). Each sparse MLP is a
replicated router (``mlp.gate``) and an experts module (``mlp.experts``) whose 3-D weights
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` are cut over ``ep`` on dim 0, the
experts; :mod:`cpshard.parallel.experts` moves the tokens to them. Layers in ``mlp_only_layers`` (or off
the ``decoder_sparse_step``) have a dense MLP (``mlp.gate_proj``...) and nothing to split.
"""

from dataclasses import replace

from cpshard.layouts.decoder import LAYOUT as DECODER

LAYOUT = replace(DECODER.for_types("qwen3_moe", "qwen3_moe"), experts=("mlp.experts",))
