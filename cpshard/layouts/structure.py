"""Reading a model against a layout: which of its modules are the layout's attention and recurrent mixers,
whether its attention calls transformers' registry (the function cp's attention replaces), and what in it
does not fit the table (:func:`structure_problems`, which the registry and the derivation turn into a clear
refusal). The table itself, data alone, is :mod:`cpshard.layouts.layout`.
"""

from __future__ import annotations

import inspect

from torch import nn

from cpshard.layouts.errors import LayoutError
from cpshard.layouts.family_attention import rewritten
from cpshard.layouts.layout import (
    HEAD_SPLIT_ATTENTION,
    HEAD_TRANSFORMS,
    HOOKED,
    RECURRENT_KERNELS,
    WHOLE_ATTENTION,
    Layout,
    Recurrent,
    config_field,
)


def kernel_slots(module: nn.Module) -> dict:
    """The kernel slots of ``module`` (the kernels package's per-module ``_kernel_funcs``), empty if none."""
    slots = module.__dict__.get("_kernel_funcs")
    return slots if isinstance(slots, dict) else {}


def serves(module: nn.Module, kernel: str) -> bool:
    """Whether ``module`` is a recurrent mixer of ``kernel``: one that holds its slot, or for a
    :data:`HOOKED` kernel, one of its class."""
    return type(module).__name__ in HOOKED[kernel] if kernel in HOOKED else kernel in kernel_slots(module)


def recurrent_module(layer: nn.Module, rows: tuple[Recurrent, ...]) -> tuple[nn.Module, Recurrent] | None:
    """The recurrent mixer ``layer`` holds and its row, or None (an attention layer)."""
    for row in rows:
        module = submodule(layer, row.module)
        if isinstance(module, nn.Module) and serves(module, row.kernel):
            return module, row
    return None


def attention_layers(layers, layout: Layout) -> list[nn.Module]:
    """The decoder layers that hold cp's attention: those with a module at attention's path that is neither
    their recurrent mixer (MiniMax's lightning layers share the name) nor pointwise nor run whole
    (:data:`WHOLE_ATTENTION`) or split by heads (:data:`HEAD_SPLIT_ATTENTION`). A layer may hold both
    (Falcon-H1 runs attention and a Mamba2 mixer side by side)."""
    found = []
    for layer in layers:
        attention = submodule(layer, layout.attention) if layout.attention else None  # "": none at all
        mixer = recurrent_module(layer, layout.recurrent)
        if isinstance(attention, nn.Module) and (mixer is None or mixer[0] is not attention):
            if type(attention).__name__ not in (*layout.pointwise, *WHOLE_ATTENTION, *HEAD_SPLIT_ATTENTION):
                found.append(layer)
        elif mixer is None:  # neither: structure_problems names it
            found.append(layer)
    return found


#: signs, in a module's own code, that it hands attention to transformers' registry
_REGISTRY_CALLS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")


def _forward_calls_registry(module: nn.Module) -> bool:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return any(call in source for call in _REGISTRY_CALLS)


def text_config(model_or_config):
    """The config that holds the decoder's sizes: a multimodal model's text part (heads, vocabulary, pad id,
    logit transforms sit there, not at its top level), else the model's own config."""
    config = getattr(model_or_config, "config", model_or_config)
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def calls_attention_registry(module: nn.Module) -> bool:
    """Whether ``module`` (or a module inside it: BERT's ``attention.self``) calls its attention function
    through transformers' registry (the function cpshard replaces); read from the source, since a class
    flag may be missing or wrong); or whose attention cpshard rewrites to call it
    (:mod:`cpshard.layouts.family_attention`). A list of attention modules (LongCat-Flash's two per layer)
    calls it when each of them does: one that did not would attend over a rank's slice alone."""
    if isinstance(module, nn.ModuleList):
        return len(module) > 0 and all(calls_attention_registry(inner) for inner in module)
    return any(_forward_calls_registry(inner) or rewritten(inner) for inner in module.modules())


def submodule(model: nn.Module, path: str):
    """``model.<path>`` or None."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def taken_inputs(layer: nn.Module, inputs: tuple) -> tuple:
    """The rows of ``inputs`` (``(key, before, after)``) that ``layer``'s forward takes: by name, or every
    one where it takes any keyword."""
    signature = inspect.signature(layer.forward).parameters
    if any(p.kind == p.VAR_KEYWORD for p in signature.values()):
        return inputs
    return tuple(row for row in inputs if row[0] in signature)


def structure_problems(model: nn.Module, layout: Layout) -> list[str]:
    """What in ``model`` does not match ``layout`` (empty when it fits)."""
    problems = []
    layers = submodule(model, layout.decoder_layers)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return [f"no list of decoder layers at {layout.decoder_layers!r}"]
    if not isinstance(submodule(model, layout.final_norm), nn.Module):
        problems.append(f"no final norm at {layout.final_norm!r}")
    if layout.layer_inputs and not taken_inputs(layers[0], layout.layer_inputs):
        names = ", ".join(key for key, _, _ in layout.layer_inputs)
        problems.append(f"its decoder layers ({type(layers[0]).__name__}) take none of {names}")
    attentions = [submodule(layer, layout.attention) for layer in attention_layers(layers, layout)]
    if not all(isinstance(module, nn.Module) for module in attentions):
        recurrent = " or a recurrent mixer of its table" if layout.recurrent else ""
        problems.append(f"not every decoder layer has an attention module {layout.attention!r}{recurrent}")
    elif not all(calls_attention_registry(module) for module in attentions):
        problems.append("it does not call attention through transformers' attention-function registry")
    config = text_config(model) if hasattr(model, "config") else None
    for attr in (layout.heads, layout.kv_heads):
        if attr is not None and not isinstance(config_field(config, attr), int):
            problems.append(f"its config has no {attr}")
    odd = [name for name in layout.head_transforms if name not in HEAD_TRANSFORMS]
    if odd:
        problems.append(f"unknown head transforms {odd}; cpshard knows {HEAD_TRANSFORMS}")
    unnamed = _unnamed_mixers(layers, layout) if problems else []
    if unnamed:  # what the problems above come of, where a layout lacks the model's recurrent rows
        problems.append(
            f"its layers hold recurrent mixers that no row of the layout's recurrent table names ("
            f"{', '.join(unnamed)}; `cpshard layout MODEL` prints the model's rows)"
        )
    return problems


def _unnamed_mixers(layers: nn.ModuleList, layout: Layout) -> list[str]:
    """``"Class at 'path'"`` for each kind of recurrent mixer in the decoder layers whose path no row of the
    layout's recurrent table names."""
    named = {row.module for row in layout.recurrent}
    found = {
        f"{type(module).__name__} at {path!r}"
        for layer in layers
        for path, module in layer.named_modules()
        if path not in named and any(serves(module, kernel) for kernel in RECURRENT_KERNELS)
    }
    return sorted(found)


def refuse_kernel_config(config, rows: tuple[Recurrent, ...]) -> None:
    """A :class:`LayoutError` where the config sets a recurrent kernel to a mode cp cannot run: xLSTM's
    ``mode="train"`` takes sequences of whole chunks only (``train_with_padding`` returns no last state),
    and every rank's slice, and the checks' short sequences, would have to be. The derivation asks before its
    recording run (which such a mode fails), the registry of every layout it resolves."""
    mode = getattr(config, "mode", None)
    if any(row.kernel == "mlstm" for row in rows) and isinstance(mode, str) and "train" in mode:
        why = (
            "returns no last state for a rank to hand on"
            if mode == "train_with_padding"
            else f"takes sequences of whole chunks only (chunk_size={getattr(config, 'chunk_size', '?')})"
        )
        raise LayoutError(
            f"xLSTM's mode={mode!r} {why}; cpshard serves mode='inference' (the config's default), which "
            "runs the same chunkwise kernel, and a recurrence for the rest, on any length, and trains "
            "alike: set config.mode = 'inference'"
        )
