"""A layout derived from the model itself: the generic decoder's table with the rows read off the model.

What is found: the decoder (``get_decoder()``, or the part of the model that holds the layers), its
list of decoder layers, the final norm before the head (the last layer in a post-norm decoder), each
layer's attention module, the head and kv-head counts, the attention's per-head parameters (sinks),
the per-position inputs each layer receives, whether the model's loss reads ``labels`` as already shifted
and whether the decoder reshapes its output to the input's length: the behaviour is read off two forwards
on a short sequence (:mod:`cpshard.layouts.recording`), no gradients.

Layers that hold a linear-attention mixer instead of attention (Gated DeltaNet, KDA: a module whose kernel
slots hold one of :data:`~cpshard.layouts.layout.RECURRENT_KERNELS`) become the layout's recurrent rows.

What is refused, naming the module and why: other token mixing along the sequence outside the attention
function (convolutions, state-space layers, attention modules that do not call transformers' attention
registry), attention that selects its keys with an indexer, or pools windows of tokens into compressed keys,
in a class cpshard has not read (it gathers the keys of those it has: :mod:`cpshard.attention.sparse`), and
what the recording refuses (a residual stream whose sequence dim cannot be told, layers of the same kind run
from a second list). A derived layout is not a tested file: cp_forward verifies it once per model on a probe
batch before trusting it (:mod:`cpshard.runtime.probe`).
"""

from __future__ import annotations

import re
from dataclasses import replace

from torch import nn

from cpshard.layouts.decoder import LAYOUT as DECODER
from cpshard.layouts.derived_plan import per_head_params, tensor_parallel_plan
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.family_attention import not_rewritten
from cpshard.layouts.layout import (
    CONV_SLOT,
    CUT_AT_ENTRY,
    HEAD_TRANSFORMS,
    HOOKED,
    PER_POSITION_ATTENTION,
    RECURRENT_KERNELS,
    SPARSE_ATTENTION,
    Layout,
    Recurrent,
    attention_at,
    gathers_keys,
)
from cpshard.layouts.recording import Recording, record_forward, restores_length
from cpshard.layouts.structure import (
    calls_attention_registry,
    kernel_slots,
    recurrent_module,
    refuse_kernel_config,
    serves,
    submodule,
    taken_inputs,
    text_config,
)

_ATTENTION_NAME = re.compile(r"atten|attn", re.IGNORECASE)
#: parameters of a state-space layer (Mamba's decay and step): it carries a state along the sequence
_STATE_PARAMETERS = ("A_log", "dt_bias", "D")


def _path_of(root: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in root.named_modules() if module is target)


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _holds_layers(module: nn.Module) -> bool:
    return any(isinstance(m, nn.ModuleList) and len(m) for m in module.modules())


def _decoder(model: nn.Module, found: nn.Module) -> nn.Module:
    """The decoder: ``get_decoder()``'s answer where it is a part of the model that holds the layers (Llama4
    answers the model itself, ModernBERT-decoder its head), else the largest child that holds them."""
    if found is not model and _holds_layers(found):
        return found
    head = model.get_output_embeddings()
    children = [c for c in model.children() if c is not head and _holds_layers(c)]
    if not children:
        raise LayoutError(f"{type(model).__name__} holds no list of decoder layers")
    return max(children, key=lambda c: sum(p.numel() for p in c.parameters()))


def _outer_lists(decoder: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The decoder's non-empty ModuleLists, by path, but those inside another list's modules: those are parts
    of a layer, not layers (LongCat-Flash's two attention sublayers in a list per layer)."""
    lists = [(name, m) for name, m in decoder.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    return [(name, m) for name, m in lists if not any(name.startswith(f"{outer}.") for outer, _ in lists)]


def _decoder_layers(decoder: nn.Module, count: int | None) -> tuple[str, nn.ModuleList]:
    """The decoder's list of layers: the shallowest of its outer lists with ``count`` modules (else the
    longest); LongCat-Flash's ``num_hidden_layers`` counts its attention sublayers, twice its layers."""
    lists = _outer_lists(decoder)
    if count is not None:
        lists = [(name, m) for name, m in lists if len(m) == count] or lists
    if not lists:
        raise LayoutError(f"{type(decoder).__name__} holds no list of decoder layers")
    return min(lists, key=lambda item: (item[0].count("."), -len(item[1])))


def _says_attention(name: str) -> bool:
    return bool(_ATTENTION_NAME.search(name)) and not name.lower().endswith("norm")


def _is_attention(module: nn.Module) -> bool:
    """By its class name; not attention across a position's own copies (Inkling2's block residuals)."""
    name = type(module).__name__
    return _says_attention(name) and name not in PER_POSITION_ATTENTION


def _looks_like_attention(name: str, child: nn.Module) -> bool:
    """Whether a layer's child ``name`` looks like attention: by its class, or a non-empty list named so
    (LongCat-Flash's ``self_attn``, two ``LongcatFlashMLA`` sublayers, whose class names do not say attention;
    not its ``post_attention_layernorm`` list); whether it calls the attention registry is asked after (a
    list calls it when each of its modules does)."""
    return (
        _is_attention(child) or isinstance(child, nn.ModuleList) and len(child) > 0 and _says_attention(name)
    )


def _attention_candidates(layer: nn.Module) -> list[str]:
    """The layer's children that look like attention, else its grandchildren (DBRX's
    ``norm_attn_norm.attn``)."""
    children = [name for name, child in layer.named_children() if _looks_like_attention(name, child)]
    return children or [
        f"{name}.{inner}"
        for name, child in layer.named_children()
        for inner, grandchild in child.named_children()
        if _is_attention(grandchild)
    ]


def _inside(name: str, path: str) -> bool:
    """Whether the module at ``name`` is the one at ``path`` or inside it (every module is inside ``""``,
    the layer)."""
    return not path or name == path or name.startswith(path + ".")


def _recurrent_rows(layers: nn.ModuleList) -> tuple[Recurrent, ...]:
    """One row per (path, kernel) of the recurrent mixers the layers hold, found by their kernel slots (a
    mixer with a convolution slot alone is a short convolution: LFM2's) or, for a hooked mixer, its class
    (Inkling's is the layer itself, whose hooks serve every convolution it holds)."""
    rows = {}
    for layer in layers:
        hooked = None  # the path of a hooked mixer found, whose hooks serve what it holds
        for name, module in layer.named_modules():
            if name.count(".") > 1 or hooked is not None and _inside(name, hooked):
                continue  # its children and theirs (Zamba2's mamba_decoder.mamba)
            slots = kernel_slots(module)
            kernels = [k for k in RECURRENT_KERNELS if serves(module, k) and (name or k in HOOKED)]
            for kernel in kernels[:1]:  # a mixer's scan before its convolution, which it runs first
                conv = CONV_SLOT if CONV_SLOT in slots and kernel != CONV_SLOT else None
                rows[name, kernel] = Recurrent(name, kernel, conv, decay=RECURRENT_KERNELS[kernel])
                hooked = name if kernel in HOOKED else hooked
    return tuple(rows.values())


def _mlp_name(layers: nn.ModuleList) -> str | None:
    """The name every decoder layer gives its MLP module: the generic layout's, else the one child of every
    layer whose class is an MLP (Bamba's and Jamba's ``feed_forward``); None where no name serves every
    layer (hybrids whose MLPs sit in some layers only)."""
    if all(isinstance(getattr(layer, DECODER.mlp, None), nn.Module) for layer in layers):
        return DECODER.mlp
    named = [
        {name for name, child in layer.named_children() if "mlp" in type(child).__name__.lower()}
        for layer in layers
    ]
    common = set.intersection(*named)
    return common.pop() if len(common) == 1 else None


def _holds_attention(layer: nn.Module, rows) -> bool:
    """Whether ``layer`` holds attention: it holds no recurrent mixer, or something that looks like
    attention beside it (Falcon-H1's layers run both side by side)."""
    found = recurrent_module(layer, rows)
    return found is None or any(name != found[1].module for name in _attention_candidates(layer))


def _refuse_known(path: str, module: nn.Module) -> None:
    """A :class:`LayoutError` that says what the attention in ``module`` (at ``path``) is, where cpshard
    knows why it does not rewrite it (:func:`not_rewritten`); nothing otherwise."""
    reason = not_rewritten(module)
    if reason:
        raise LayoutError(
            f"{path} ({type(module).__name__}) is {reason}, which cpshard does not rewrite onto "
            "transformers' attention registry: cp cannot serve it; run this model without cp"
        )


def _first_custom(path: str, module: nn.Module) -> tuple[str, nn.Module]:
    """The attention module at ``path`` that does not call the attention registry, with its path: in a list of
    them (LongCat-Flash's), the first that does not, so that the refusal names the module, not the list."""
    if isinstance(module, nn.ModuleList):
        return next(
            (f"{path}.{i}", inner) for i, inner in enumerate(module) if not calls_attention_registry(inner)
        )
    return path, module


def _attention_name(layers: list[tuple[int, nn.Module]], layers_path: str) -> tuple[str, tuple[str, ...]]:
    """The path in every layer that holds no recurrent mixer (``(index, layer)`` pairs) of its attention
    module (one that calls transformers' attention registry), and the class names of the modules some
    layers hold there instead that are not attention by name (Nemotron-H's MLP and MoE layers: pointwise,
    which the probe verifies); ``("", ())`` where every layer holds a recurrent mixer."""
    if not layers:
        return "", ()
    candidates = dict.fromkeys(name for _, layer in layers for name in _attention_candidates(layer))
    for name in candidates:
        modules = [(index, submodule(layer, name)) for index, layer in layers]
        if all(isinstance(m, nn.Module) for _, m in modules):
            odd = [(i, m) for i, m in modules if not calls_attention_registry(m)]
            custom = [(i, m) for i, m in odd if _is_attention(m) or isinstance(m, nn.ModuleList)]
            custom = custom or (odd if len(odd) == len(modules) else [])
            if custom:
                path, module = _first_custom(f"{layers_path}.{custom[0][0]}.{name}", custom[0][1])
                _refuse_known(path, module)
                raise LayoutError(
                    f"{path} ({type(module).__name__}) does not call attention through transformers' "
                    "attention registry, so cp cannot make it attend over the whole sequence (linear or "
                    "custom attention mixes tokens where cp cannot see)"
                )
            return name, tuple(sorted({type(m).__name__ for _, m in odd}))
    _refuse_known(f"{layers_path}.{layers[0][0]}", layers[0][1])
    first = _attention_candidates(layers[0][1])
    raise LayoutError(
        f"not every layer of {layers_path} ({type(layers[0][1]).__name__}) has an attention module"
        + (f" (found {first} in the first)" if first else "")
    )


def _token_mixers(layers: nn.ModuleList, layers_path: str, served: tuple[Recurrent, ...]) -> list[str]:
    """Modules inside the layers that mix tokens along the sequence by themselves: convolutions, state (but
    the recurrent mixers of ``served`` and what they hold), compressors (pooled keys, whose windows a short
    probe may not fill, so it cannot vouch for them; but those inside attention whose keys cp gathers whole,
    DeepSeek-V4's: :mod:`cpshard.attention.sparse`)."""
    found = []
    for index, layer in enumerate(layers):
        mixer = {row.module for row in served if submodule(layer, row.module) is not None}
        mixer |= {name for name, module in layer.named_modules() if gathers_keys(module)}
        for name, module in layer.named_modules():
            if any(_inside(name, path) for path in mixer):
                continue
            path = _join(layers_path, str(index), name)
            if isinstance(module, nn.modules.conv._ConvNd):
                found.append(f"{path} ({type(module).__name__}: a convolution along the sequence)")
            elif any(isinstance(module._parameters.get(p), nn.Parameter) for p in _STATE_PARAMETERS[:2]):
                found.append(f"{path} ({type(module).__name__}: a state-space layer carries state along it)")
            elif name.rpartition(".")[2] == "compressor" or type(module).__name__.endswith("Compressor"):
                found.append(
                    f"{path} ({type(module).__name__}: it pools windows of tokens into compressed keys)"
                )
    return found


def _key_selectors(layers: nn.ModuleList, layers_path: str) -> list[str]:
    """The indexers inside the layers: sparse attention that selects keys per query (DeepSeek-V3.2's, GLM-5's,
    Kolibri 1.1's, HY-V4's, MiniMax-M3's sparse layers), refused where its attention class is not one cp
    gathers the keys of. Found by module, not by config: a config may declare an indexer that no layer
    builds."""
    return [
        f"{_join(layers_path, str(index), name)} ({type(module).__name__})"
        for index, layer in enumerate(layers)
        for name, module in layer.named_modules()
        if name.rpartition(".")[2] == "indexer" or type(module).__name__.endswith("Indexer")
    ]


def _sparse_attention(layers: nn.ModuleList, attention: str) -> tuple[str, ...]:
    """``(attention,)`` where every layer's attention module is one of the sparse attention classes cp serves
    with gathered keys (:data:`SPARSE_ATTENTION`) and some select keys (DeepSeek-V4's sliding layers alone do
    not: cp's ordinary attention), else ``()`` (an indexer of another kind is refused)."""
    if not attention:
        return ()
    modules = [submodule(layer, attention) for layer in layers]
    served = all(type(module).__name__ in SPARSE_ATTENTION for module in modules)
    return (attention,) if served and any(gathers_keys(module) for module in modules) else ()


def _final_norm(decoder: nn.Module, top: str, ran: tuple[str, ...]) -> str | None:
    """The decoder's child that gives its final hidden states: the last norm that ran after ``top`` (the
    child holding the layers; where nothing ran, on the meta device, the last registered after it or
    one named final, as OPT registers it before them); None in a post-norm decoder (BERT, Marian)."""
    order = list(ran) or [name for name, _ in decoder.named_children()]
    after = order[len(order) - order[::-1].index(top) :] if top in order else []
    if not ran:
        after += [name for name in order if "final" in name]
    norms = [n for n in after if "norm" in type(getattr(decoder, n)).__name__.lower()]
    return norms[-1] if norms else None


def _last_stack_norm(decoder: nn.Module, ran: tuple[str, ...]) -> tuple[str | None, int]:
    """Where a second stack of layers runs beside the decoder's list (HRM's H stack, last in every cycle):
    the last norm the decoder's child that ran last holds, which gives the decoder's output (HRM's
    ``H_module.final_norm``), and how many times it runs per forward (once per cycle)."""
    last = ran[-1]
    norms = [n for n, m in getattr(decoder, last).named_children() if "norm" in type(m).__name__.lower()]
    return (f"{last}.{norms[-1]}" if norms else None), ran.count(last)


def _without_heads(config, decoder: nn.Module, decoder_path: str) -> LayoutError:
    """Why the generic layout cannot serve a model whose config names no ``num_attention_heads``: where its
    decoder runs more than one list of layers that attend, each sized by a config of its own (BLT's byte
    encoder, global transformer over patches pooled from the bytes, byte decoder and patcher), that it has no
    one decoder, and needs a layout file of its own."""
    stacks = [
        _join(decoder_path, name)
        for name, layers in _outer_lists(decoder)
        if any(_is_attention(module) for module in layers.modules())
    ]
    if len(stacks) < 2:
        return LayoutError(f"{type(config).__name__} has no num_attention_heads")
    return LayoutError(
        f"{type(config).__name__} has no num_attention_heads of one decoder: its model runs "
        f"{len(stacks)} lists of layers that attend ({', '.join(stacks)}), each sized by a config of its "
        "own, while the generic layout reads one list of decoder layers over one sequence: such a model "
        "needs a layout file of its own, which says where each sequence is cut (BLT's, "
        "cpshard/layouts/blt.py, cuts its bytes and its patches)"
    )


def _config_value(config, name: str):
    """``config.<name>``, or None where it is missing or varies per layer (Gemma4 raises on reading it)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 -- transformers' per-layer attributes raise their own error types
        return None


def derive_layout(model: nn.Module) -> Layout:
    """The layout of ``model`` read off the model; a :class:`LayoutError` naming what cp cannot serve."""
    top_config, get_decoder = getattr(model, "config", None), getattr(model, "get_decoder", None)
    if top_config is None or get_decoder is None:
        raise LayoutError("it is not a transformers model (no config, no get_decoder)")
    config = text_config(top_config)  # a multimodal model's decoder sizes sit in its text part
    decoder = _decoder(model, get_decoder())
    decoder_path = _path_of(model, decoder)
    inner, layers = _decoder_layers(decoder, getattr(config, "num_hidden_layers", None))
    layers_path = _join(decoder_path, inner)
    recurrent = _recurrent_rows(layers)
    refuse_kernel_config(config, recurrent)
    with_attention = [(i, layer) for i, layer in enumerate(layers) if _holds_attention(layer, recurrent)]
    attention, pointwise = _attention_name(with_attention, layers_path)
    with_attention = [
        (i, layer)
        for i, layer in with_attention
        if type(submodule(layer, attention)).__name__ not in pointwise
    ]
    mixers = _token_mixers(layers, layers_path, recurrent)
    if mixers:
        more = f" ({len(mixers) - 1} more such modules)" if len(mixers) > 1 else ""
        raise LayoutError(
            f"{mixers[0]}: it mixes tokens along the sequence outside the attention function, where each cp "
            f"rank would see its own slice only{more}"
        )
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise _without_heads(config, decoder, decoder_path)
    kv_heads = (
        "num_key_value_heads" if isinstance(getattr(config, "num_key_value_heads", None), int) else None
    )
    width = "intermediate_size" if isinstance(getattr(config, "intermediate_size", None), int) else None
    head_dim = (
        _config_value(config, "head_dim") or (_config_value(config, "hidden_size") or 0) // heads or None
    )
    plan = tensor_parallel_plan(with_attention[0][1], attention, head_dim) if with_attention else {}
    top = inner.split(".")[0]  # the decoder's child that holds the layers
    if any(p.is_meta for p in model.parameters()):  # nothing can run: the generic inputs the layers take
        recording = Recording(taken_inputs(layers[0], DECODER.layer_inputs), (), False)
    else:
        recording = record_forward(model, decoder, layers, layers_path, top)
    sparse = _sparse_attention(layers, attention)
    indexers = [] if sparse else _key_selectors(layers, layers_path)
    if indexers:
        raise LayoutError(
            f"{indexers[0]}: an indexer selects keys per query (sparse attention) inside the attention "
            "module, where each cp rank would score its own slice; on a sequence no longer than its "
            "selection it takes every key, so a short probe cannot vouch for it. cp serves the sparse "
            f"attention of {', '.join(SPARSE_ATTENTION)}, not this kind yet: run this model without cp"
        )
    norm = _final_norm(decoder, top, recording.children)
    runs = recording.children.count(norm) if recording.looped and norm else 1
    if recording.beside:
        norm, runs = _last_stack_norm(decoder, recording.children)
    final = _join(decoder_path, norm) if norm else _join(layers_path, str(len(layers) - 1))
    restores = bool(recording.children) and restores_length(model, model.get_submodule(final), runs)
    # its layers' inputs come cut: by Inkling2's mixers' hooks, by HRM's decoder's (a second stack beside)
    at_entry = any(row.kernel in CUT_AT_ENTRY for row in recurrent) or bool(recording.beside)
    transforms = tuple(name for name in HEAD_TRANSFORMS if getattr(config, name, None))
    entries = [p for p in DECODER.tensor_parallel_inputs if any(hasattr(layer, p) for layer in layers)]
    attentions = [module for _, layer in with_attention for module in attention_at(layer, attention)]
    # fmt: off
    # a table, as the registered files write one
    return replace(
        DECODER,
        name=f"derived:{top_config.model_type}", model_types=(top_config.model_type,),
        decoder=decoder_path, decoder_layers=layers_path, attention=attention, final_norm=final,
        kv_heads=kv_heads, mlp_width=width, mlp=_mlp_name(layers), hidden=recording.hidden,
        cut_at_entry=at_entry, layer_inputs=() if at_entry else recording.layer_inputs,
        head_transforms=transforms, labels_shifted=recording.labels_shifted, restores_length=restores,
        tensor_parallel=plan, tensor_parallel_inputs=tuple(entries) if plan else (),
        per_head_params=per_head_params(attentions, heads),
        recurrent=recurrent, pointwise=pointwise, sparse_attention=sparse, looped=recording.looped,
    )
    # fmt: on
