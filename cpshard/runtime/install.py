"""The one install step: what cp_forward puts into a model, once, and checks on every call.

``install(model, layout)`` registers cpshard's attention function around the model's own, the cut
(forward pre-hooks on the decoder layers, hooks on the final norm and the LM head), the recurrent mixers'
kernel and convolution slots (:mod:`cpshard.recurrent.slots`), for a mixture of
experts the expert-parallel experts function, for ``make_cp_forward``'s ``mlp_tile`` the MLP modules'
tiled forward, and for its ``attention_recompute`` the attention modules' recomputed forward (each acts
as the running call's options say; the tensor-parallel hooks go in
at the first call with tp > 1). Each acts only inside a cp_forward call (see :mod:`cpshard.call`);
outside one the model gives its ordinary results.

Installing is idempotent: cpshard's hooks carry a mark, and a model that already holds them (installed
before, or a ``copy.deepcopy`` of a prepared model) has them replaced, never doubled. Every call checks
that the model still dispatches to cpshard's attention (a second model built from the same config, or
``set_attn_implementation``, can switch it back): a switched model is wrapped again around whatever it
now uses, so attention never runs on a slice of the sequence alone.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from cpshard.attention.cp_attention import PREFIX as ATTENTION_PREFIX
from cpshard.attention.cp_attention import cp_attention_name
from cpshard.attention.sparse import sparse_attention_hooks, undifferentiated_modules
from cpshard.interfaces import install_hooks
from cpshard.layouts.family_attention import rewrite, rewritten
from cpshard.layouts.layout import Layout, attention_at
from cpshard.layouts.structure import attention_layers
from cpshard.parallel.experts import PREFIX as EXPERTS_PREFIX
from cpshard.parallel.experts import experts_modules, install_experts
from cpshard.parallel.tensor import tensor_parallel_hooks
from cpshard.recurrent.slots import entry_hooks, install_recurrent
from cpshard.runtime.cut import cut_hooks
from cpshard.runtime.recompute import RecomputedForward, UndifferentiatedForward, install_forward
from cpshard.runtime.tiled_mlp import install_tiled_mlp


def attention_modules(model: nn.Module, layout: Layout) -> list[nn.Module]:
    """The attention modules of every layer that holds attention (not a recurrent mixer): one a layer, or
    each of a layer's list of them (LongCat-Flash's two)."""
    layers = model.get_submodule(layout.decoder_layers)
    return [
        module
        for layer in attention_layers(layers, layout)
        for module in attention_at(layer, layout.attention)
    ]


def install_attention(model: nn.Module, layout: Layout) -> None:
    """Make the model dispatch to cpshard's attention around the function it uses now (nothing when it
    does, or when no layer attends: RWKV's)."""
    modules = attention_modules(model, layout)
    if not modules:
        return
    in_use = {name for name in _implementations(model, modules) if name is not None}
    unwrapped = sorted(name for name in in_use if not name.startswith(ATTENTION_PREFIX))
    if len(unwrapped) > 1:
        raise ValueError(
            f"{type(model).__name__}'s attention modules use {', '.join(unwrapped)} at once; cpshard "
            "wraps one attention implementation per model: set one with model.set_attn_implementation"
        )
    if unwrapped:
        _set_implementation(model, cp_attention_name(unwrapped[0]), layout)


def _implementations(model: nn.Module, modules: list[nn.Module]) -> set[str | None]:
    """The attention implementations the layout's attention ``modules`` dispatch to: their own configs'
    (a multimodal model's text part), the model's for a module that holds none. Not the top-level config's,
    which a part that keeps its own attention code holds back (GOT-OCR2's vision tower, which cp never runs:
    its forward takes token ids and labels alone)."""
    configs = [getattr(module, "config", None) for module in modules]
    configs = [config if isinstance(config, PretrainedConfig) else model.config for config in configs]
    return {getattr(config, "_attn_implementation", None) for config in configs}


def _set_implementation(model: nn.Module, name: str, layout: Layout) -> None:
    """``model`` (and its sub-models) dispatch attention to ``name``. transformers declines to switch a family
    whose attention is its own code; cpshard has rewritten that code to dispatch, so it sets the name."""
    if any(rewritten(m) for attention in attention_modules(model, layout) for m in attention.modules()):
        for module in model.modules():
            if isinstance(getattr(module, "config", None), PretrainedConfig):
                module.config._attn_implementation_internal = name
    else:
        model.set_attn_implementation(name)
    taken = _implementations(model, attention_modules(model, layout))
    if taken != {name}:
        raise ValueError(
            f"{type(model).__name__}'s attention modules did not take the attention implementation {name!r} "
            f"(they have {sorted(map(str, taken))}), so cp's attention would not run: report this model type"
        )


def install(model: nn.Module, layout: Layout, tiles_mlp: bool = False, recomputes_attention: bool = False):
    """Put cpshard's attention, cut, tensor- and expert-parallel pieces into ``model`` (idempotent), and the
    forwards of the memory modes a cp forward asks for."""
    for attention in attention_modules(model, layout):
        for module in attention.modules():
            if rewritten(module):  # Bloom, GPT-Neo, MPT, XGLM: through the registry from now on
                rewrite(module, model.config)
    install_attention(model, layout)
    layers = model.get_submodule(layout.decoder_layers)
    # one install: a recurrent mixer may be the layer itself (Inkling's), which holds a cut hook too
    final_norm, head = model.get_submodule(layout.final_norm), model.get_output_embeddings()
    cut = cut_hooks(layers, final_norm, head, layout)
    sparse = sparse_attention_hooks(layers, layout.decoder_layers, layout.sparse_attention)
    recurrent = install_recurrent(layers, layout.recurrent, layout.decoder_layers)
    entry = entry_hooks(model.get_submodule(layout.decoder), layers, layout)
    install_hooks(cut + recurrent + entry + sparse)
    install_forward(undifferentiated_modules(layers, layout.sparse_attention), UndifferentiatedForward)
    if layout.experts:
        install_experts(model)
    if tiles_mlp:
        install_tiled_mlp(layers, layout)
    if recomputes_attention:
        install_forward(attention_modules(model, layout), RecomputedForward)


def ensure_installed(model: nn.Module, layout: Layout, tp: int) -> None:
    """Before each call: a model switched back to another attention (or experts) function is wrapped again;
    the tensor-parallel hooks go in at the first call with ``tp > 1`` (they act only there, and a layer
    compiled for cp alone then traces none of them)."""
    install_attention(model, layout)
    if tp > 1:
        install_hooks(tensor_parallel_hooks(model.get_submodule(layout.decoder_layers), layout))
    experts = experts_modules(model).values() if layout.experts else ()
    if any(not module.config._experts_implementation.startswith(EXPERTS_PREFIX) for module in experts):
        install_experts(model)
