"""The parallel rows of a derived layout, read off one decoder layer: the generic decoder's tensor-parallel
plan for the modules the layer has (blocks split by columns and joined by rows only), its per-head norms,
and the attention's own per-head parameters (sinks). :mod:`cpshard.layouts.derive` reads the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from cpshard.layouts.decoder import LAYOUT as DECODER


def per_head_params(attentions: list[nn.Module], heads: int) -> tuple[str, ...]:
    """The attention modules' own parameters with one entry per head (sinks; some layers may have none)."""
    names = {}
    for attention in attentions:
        counts = {
            heads,
            getattr(attention, "num_heads", None),
            getattr(attention, "num_attention_heads", None),
        }
        for name, p in attention.named_parameters(recurse=False):
            if p.dim() == 1 and p.shape[0] in counts:
                names[name] = None
    return tuple(names)


def _both_halves(plan: dict, block: str) -> bool:
    """Whether the plan splits ``block`` (``self_attn``, ``mlp``) by columns and joins it by rows: a half
    alone would split a whole input or leave a split output (GLM's fused ``gate_up_proj`` leaves
    ``down_proj``, Phi's ``dense`` leaves q/k/v), so such a block runs whole on every tp rank."""
    styles = {style for path, style in plan.items() if path.rsplit(".", 1)[0] == block}
    return {"colwise", "rowwise"} <= styles


def tensor_parallel_plan(layer: nn.Module, attention: str, head_dim: int | None) -> dict:
    """The generic plan's rows for the modules this layer has, for blocks that have both halves; the
    attention's norms of one head's width (q_norm, HunYuan's query_layernorm) per head. Any other
    parameter in a split block is refused under tp (:func:`cpshard.parallel.tensor.check_tensor_parallel`)."""
    present = {name for name, _ in layer.named_modules()}
    plan = {path: style for path, style in DECODER.tensor_parallel.items() if path in present}
    plan = {path: style for path, style in plan.items() if _both_halves(plan, path.rsplit(".", 1)[0])}
    for name, module in layer.get_submodule(attention).named_children():
        weight = getattr(module, "weight", None)
        one_head = isinstance(weight, torch.Tensor) and head_dim is not None and weight.shape == (head_dim,)
        if one_head and "norm" in type(module).__name__.lower():
            plan[f"{attention}.{name}"] = "per_head"
    return plan if "self_attn.q_proj" in plan else {}
