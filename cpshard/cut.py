"""Where the sequence is cut: forward pre-hooks on the decoder layers.

Everything before the first layer (embeddings, rotary, the masks) runs on the whole sequence,
so masks stay exact; the first layer slices the residual stream, and every layer slices the
per-layer inputs it receives (each layer may get its own rotary pair). Slices need no
communication. Outside a cp call the hooks step aside.
"""

from __future__ import annotations

from functools import partial

import torch

from cpshard.context import active_call
from cpshard.layout import Layout
from cpshard.redistribute import redistribute


def _cut(value, before, after, mesh):
    if isinstance(value, torch.Tensor):
        return redistribute(value, before, after, mesh)
    if isinstance(value, tuple):
        return tuple(_cut(v, before, after, mesh) for v in value)
    return value


def _cut_layer_inputs(first: bool, module, args, kwargs):
    call = active_call()
    if call is None:
        return None
    layout = call.layout
    if first:
        if args:
            args = (_cut(args[0], *layout.hidden, call.mesh), *args[1:])
        else:
            kwargs["hidden_states"] = _cut(kwargs["hidden_states"], *layout.hidden, call.mesh)
    for key, before, after in layout.layer_inputs:
        if kwargs.get(key) is not None:
            kwargs[key] = _cut(kwargs[key], before, after, call.mesh)
    return args, kwargs


def install_cut(layers: torch.nn.ModuleList) -> list:
    """Hook every decoder layer; return the hook handles."""
    return [
        layer.register_forward_pre_hook(partial(_cut_layer_inputs, index == 0), with_kwargs=True)
        for index, layer in enumerate(layers)
    ]
