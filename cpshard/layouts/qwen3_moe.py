"""Qwen3-MoE: Qwen3's table for attention; the sparse layers' experts split over ``ep``.

Each sparse MLP is a replicated router (``mlp.gate``) and an experts module (``mlp.experts``) whose 3-D
weights ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` are cut over ``ep`` on dim 0, the
experts; :mod:`cpshard.parallel.experts` moves the tokens to them. Layers in ``mlp_only_layers`` (or off
the ``decoder_sparse_step``) have a dense MLP (``mlp.gate_proj``...) and nothing to split over ``ep``.
Under ``tp`` attention and the dense MLPs split by Qwen3's rows; the router stays replicated and the
experts split over ``ep`` alone, the tp ranks sharing out their tokens' pairs (see
:mod:`cpshard.parallel.experts`).
"""

from cpshard.layouts.qwen3 import LAYOUT as QWEN3

LAYOUT = QWEN3.with_rows(name="qwen3_moe", model_types=("qwen3_moe",), experts=("mlp.experts",))
