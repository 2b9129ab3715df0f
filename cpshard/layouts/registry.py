"""The layout registry: one file per architecture, and the generic decoder for the rest."""

from __future__ import annotations

import inspect

from torch import nn

from cpshard.layouts import decoder, gemma3, llama, mistral, qwen3, qwen3_moe
from cpshard.layouts.layout import Layout

_FILES = (llama, mistral, qwen3, qwen3_moe, gemma3)
REGISTERED: dict[str, Layout] = {
    model_type: module.LAYOUT for module in _FILES for model_type in module.LAYOUT.model_types
}
#: every layout by its own name (``layout="gemma3"``), the generic one included
BY_NAME: dict[str, Layout] = {layout.name: layout for layout in (decoder.LAYOUT, *(m.LAYOUT for m in _FILES))}


def submodule(model: nn.Module, path: str):
    """``model.<path>`` or None."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def structure_problems(model: nn.Module, layout: Layout) -> list[str]:
    """What in ``model`` does not match ``layout`` (empty when it fits)."""
    problems = []
    layers = submodule(model, layout.decoder_layers)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return [f"no list of decoder layers at {layout.decoder_layers!r}"]
    if "position_embeddings" not in inspect.signature(layers[0].forward).parameters:
        problems.append(f"its decoder layers ({type(layers[0]).__name__}) take no position_embeddings")
    if not all(isinstance(getattr(layer, layout.attention, None), nn.Module) for layer in layers):
        problems.append(f"not every decoder layer has an attention module {layout.attention!r}")
    if not getattr(model, "_supports_attention_backend", False):
        problems.append("it does not call attention through transformers' attention-function registry")
    config = getattr(model, "config", None)
    for attr in (layout.heads, layout.kv_heads):
        if not isinstance(getattr(config, attr, None), int):
            problems.append(f"its config has no {attr}")
    return problems


def resolve_layout(model: nn.Module, layout: Layout | str = "auto") -> Layout:
    """The layout for ``model``: the one given, the one registered for its type, else the generic one."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if isinstance(layout, Layout):
        chosen = layout
    elif layout == "auto":
        chosen = REGISTERED.get(model_type, decoder.LAYOUT)
    elif layout in BY_NAME or layout in REGISTERED:
        chosen = BY_NAME.get(layout) or REGISTERED[layout]
    else:
        raise ValueError(
            f"unknown layout {layout!r}; name one of {', '.join(sorted(BY_NAME))}, a model type of "
            f"{', '.join(sorted(REGISTERED))}, or 'auto'"
        )
    problems = structure_problems(model, chosen)
    if problems:
        raise ValueError(
            f"cpshard cannot serve model type {model_type!r} ({type(model).__name__}) with layout "
            f"{chosen.name!r}: {'; '.join(problems)}. Supported: {', '.join(sorted(REGISTERED))}, and any "
            "transformers decoder that fits the generic layout; another architecture needs its own file "
            "in cpshard/layouts/"
        )
    return chosen
