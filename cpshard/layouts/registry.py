"""The layout registry: one file per architecture, and the generic decoder for the rest."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from cpshard.layouts import (
    blt,
    decoder,
    gemma3,
    granitemoehybrid,
    llama,
    mistral,
    nemotron_h,
    prophetnet,
    qwen3,
    qwen3_moe,
    qwen3_next,
    reformer,
    xlm,
)
from cpshard.layouts.derive import derive_layout
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.family_attention import check_unchanged
from cpshard.layouts.layout import Layout
from cpshard.layouts.structure import refuse_kernel_config, structure_problems, text_config
from cpshard.streams import forked_streams

_FILES = (
    llama,
    mistral,
    qwen3,
    qwen3_moe,
    gemma3,
    qwen3_next,
    nemotron_h,
    granitemoehybrid,
    xlm,
    prophetnet,
    reformer,
    blt,
)
REGISTERED: dict[str, Layout] = {
    model_type: module.LAYOUT for module in _FILES for model_type in module.LAYOUT.model_types
}
#: every layout by its own name (``layout="gemma3"``), the generic one included
BY_NAME: dict[str, Layout] = {layout.name: layout for layout in (decoder.LAYOUT, *(m.LAYOUT for m in _FILES))}


def _derived(model: nn.Module, model_type: str) -> Layout:
    if any(isinstance(p, DTensor) for p in model.parameters()):  # the recording run below would fail inside
        raise LayoutError(
            f"cpshard derives the layout of model type {model_type!r} ({type(model).__name__}) from a run of "
            "the model on its plain parameters, and they are DTensors now (cpshard.parallelize): make the cp "
            "forward before parallelizing, make_cp_forward(model), and call it once with "
            "cpshard.params_of(model) on a mesh without tp or ep (cpshard.make_mesh(cp=...)), which probes "
            "the layout against one process; then cpshard.parallelize(model, mesh) and call it with the "
            "parallel parameters"
        )
    try:
        with forked_streams(model):  # the recording runs draw nothing from the caller's streams
            return derive_layout(model)
    except LayoutError as error:
        raise LayoutError(
            f"cpshard cannot serve model type {model_type!r} ({type(model).__name__}): {error}. "
            "Layout files: "
            f"{', '.join(sorted(REGISTERED))}; others are derived from the model where cp can serve them"
        ) from None


def model_type_of(model: nn.Module) -> str:
    """The type the registry knows ``model`` by: its config's ``model_type``, else its class name."""
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def _check_language_model(model) -> None:
    """A :class:`LayoutError` where ``model`` is a transformers model without a language-model head: cp's
    loss and logits come of the head (a base model, ``AutoModel``'s, has none)."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    if callable(output_embeddings) and output_embeddings() is None:
        raise LayoutError(
            f"{type(model).__name__} has no language-model head (its get_output_embeddings() is None): cp "
            "computes a causal LM's loss and logits; load it with AutoModelForCausalLM (e.g. "
            "LlamaForCausalLM, not LlamaModel)"
        )


def _check_not_peft(model) -> None:
    """A :class:`LayoutError` where ``model`` is PEFT's wrapper (a ``PeftModel``): its parameters are named
    under its own prefix and its forward is not the model's, while the model it wraps carries the adapters
    in its own modules and runs under cp as any model does."""
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        inner = type(model.get_base_model()).__name__
        raise LayoutError(
            f"{type(model).__name__} is PEFT's wrapper around a {inner}: pass model.get_base_model() (the "
            f"{inner} with its adapters in place) to make_cp_forward and cpshard.params_of; the adapters "
            "train, and the frozen weights keep no gradient under backward(), as in one process"
        )


def resolve_layout(model: nn.Module, layout: Layout | str = "auto") -> Layout:
    """The layout for ``model``: the one given, the one registered for its type, else one derived from it
    (a model whose code cpshard rewrites is checked first: it must be the code its rewrite was made for)."""
    _check_not_peft(model)
    _check_language_model(model)
    check_unchanged(model)
    model_type = model_type_of(model)
    if isinstance(layout, Layout):
        chosen = layout
    elif layout == "auto":
        chosen = REGISTERED.get(model_type) or _derived(model, model_type)
    elif layout in BY_NAME or layout in REGISTERED:
        chosen = BY_NAME.get(layout) or REGISTERED[layout]
    else:
        raise ValueError(
            f"unknown layout {layout!r}; name one of {', '.join(sorted(BY_NAME))}, a model type of "
            f"{', '.join(sorted(REGISTERED))}, or 'auto'"
        )
    refuse_kernel_config(text_config(model), chosen.recurrent)
    problems = structure_problems(model, chosen)
    if problems:
        way_out = (
            f"check its rows against the model (`cpshard layout {model_type}` prints the layout cpshard uses)"
            if isinstance(layout, Layout)
            else f"Supported: {', '.join(sorted(REGISTERED))}, and any transformers decoder that fits the "
            "generic layout; another architecture needs its own file in cpshard/layouts/"
        )
        raise LayoutError(
            f"cpshard cannot serve model type {model_type!r} ({type(model).__name__}) with layout "
            f"{chosen.name!r}: {'; '.join(problems)}. {way_out}"
        )
    return chosen
