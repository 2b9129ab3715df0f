"""A layout derived from the model itself: the generic decoder's table with the rows read off the model.

What is found: the decoder (``get_decoder()``), its list of decoder layers, the final norm before
the head, each layer's attention module, the head and kv-head counts, the attention's per-head
parameters (sinks) and the per-position inputs each layer receives. The last are found by running
the model once on a short sequence (no gradients) and recording what each decoder layer is given.

What is refused, naming the module and why: token mixing along the sequence outside the attention
function (convolutions, state-space and linear-attention layers, attention modules that do not call
transformers' attention registry), a residual stream not shaped ``[b, s, d]`` and layers entered
more than once per forward. A derived layout is not a tested file: cp_forward verifies it once per
model on a probe sequence before trusting it (:mod:`cpshard.runtime.probe`).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from cpshard.layouts.decoder import LAYOUT as DECODER
from cpshard.layouts.layout import HEAD_TRANSFORMS, Layout, LayoutError, calls_attention_registry, specs

#: the sequence length of the recording run: odd and prime, so no other size is mistaken for it
PROBE_LENGTH = 13
_ATTENTION_NAME = re.compile(r"atten|attn", re.IGNORECASE)
#: parameters of a state-space layer (Mamba's decay and step): it carries a state along the sequence
_STATE_PARAMETERS = ("A_log", "dt_bias", "D")


def _path_of(root: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in root.named_modules() if module is target)


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _decoder_layers(decoder: nn.Module, count: int | None) -> tuple[str, nn.ModuleList]:
    """The decoder's list of layers: the shallowest ModuleList of ``count`` modules (else the longest)."""
    lists = [(name, m) for name, m in decoder.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if count is not None:
        lists = [(name, m) for name, m in lists if len(m) == count] or lists
    if not lists:
        raise LayoutError(f"{type(decoder).__name__} holds no list of decoder layers")
    return min(lists, key=lambda item: (item[0].count("."), -len(item[1])))


def _attention_name(layers: nn.ModuleList, layers_path: str) -> str:
    """The name of every layer's attention module (one that calls transformers' attention registry)."""
    first = [
        name
        for name, child in layers[0].named_children()
        if _ATTENTION_NAME.search(type(child).__name__) and "norm" not in type(child).__name__.lower()
    ]
    for name in first:
        modules = [getattr(layer, name, None) for layer in layers]
        if all(isinstance(m, nn.Module) for m in modules):
            odd = [i for i, m in enumerate(modules) if not calls_attention_registry(m)]
            if odd:
                kind = type(modules[odd[0]]).__name__
                raise LayoutError(
                    f"{layers_path}.{odd[0]}.{name} ({kind}) does not call attention "
                    "through transformers' attention registry, so cp cannot make it attend over the whole "
                    "sequence (linear or custom attention mixes tokens where cp cannot see)"
                )
            return name
    raise LayoutError(
        f"not every layer of {layers_path} ({type(layers[0]).__name__}) has an attention module"
        + (f" (found {first} in the first)" if first else "")
    )


def _token_mixers(layers: nn.ModuleList, layers_path: str) -> list[str]:
    """Modules inside the layers that mix tokens along the sequence by themselves: convolutions, state."""
    found = []
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            path = _join(layers_path, str(index), name)
            if isinstance(module, nn.modules.conv._ConvNd):
                found.append(f"{path} ({type(module).__name__}: a convolution along the sequence)")
            elif any(isinstance(module._parameters.get(p), nn.Parameter) for p in _STATE_PARAMETERS[:2]):
                found.append(f"{path} ({type(module).__name__}: a state-space layer carries state along it)")
    return found


def _final_norm(decoder: nn.Module, decoder_path: str, layers_path: str) -> str:
    """The norm the decoder applies after its layers: the last norm registered after the layer list, else
    the one named final (OPT registers it before its layers)."""
    names = [name for name, _ in decoder.named_children()]
    top = layers_path[len(decoder_path) :].lstrip(".").split(".")[0]
    norms = [n for n in names if "norm" in type(getattr(decoder, n)).__name__.lower()]
    after = [n for n in norms if names.index(n) > names.index(top)] or [n for n in norms if "final" in n]
    if not after:
        raise LayoutError(
            f"{type(decoder).__name__} has no norm after its layers ({', '.join(names)}): cpshard hooks the "
            "last module before the LM head"
        )
    return _join(decoder_path, after[-1])


def _per_head_params(attentions: list[nn.Module], heads: int) -> tuple[str, ...]:
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


def _sequence_spec(tensor: torch.Tensor) -> tuple | None:
    """(before, after) specs for a per-position tensor ``[b, s, ...]``: a slice of dim 1 over cp."""
    if tensor.dim() < 2 or tensor.shape[1] != PROBE_LENGTH:
        return None
    rest = " ".join(f"x{i}" for i in range(tensor.dim() - 2))
    return specs(f"b s {rest}".strip(), f"b s@cp {rest}".strip())


def _recorded_inputs(model: nn.Module, layers: nn.ModuleList, layers_path: str) -> tuple:
    """Run the model once on a short sequence and read off what each layer receives per position."""
    seen, calls = {}, []

    def record(module, args, kwargs):
        calls.append(module)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if module is layers[0] and (not isinstance(hidden, torch.Tensor) or hidden.dim() != 3):
            shape = list(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            seen["hidden"] = shape
        for key, value in kwargs.items():
            parts = value if isinstance(value, tuple) else (value,)
            if "mask" in key or not all(isinstance(v, torch.Tensor) for v in parts):
                continue
            pair = _sequence_spec(parts[0])
            if pair is not None and all(_sequence_spec(v) == pair for v in parts):
                seen.setdefault("inputs", {})[key] = pair

    if any(p.is_meta for p in model.parameters()):  # nothing can run: the generic decoder's inputs
        return DECODER.layer_inputs
    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    ids = torch.arange(PROBE_LENGTH).remainder(max(getattr(model.config, "vocab_size", 2) - 3, 1)) + 3
    try:
        with torch.no_grad():
            model(input_ids=ids.unsqueeze(0).to(next(model.parameters()).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if "hidden" in seen:
        raise LayoutError(
            f"{layers_path}.0 receives a residual stream of shape {seen['hidden']}, not [batch, sequence, "
            "hidden]: cpshard cuts a stream of that shape only"
        )
    if calls.count(layers[0]) > 1:
        raise LayoutError(
            f"{layers_path}.0 runs {calls.count(layers[0])} times in one forward (looped layers): the "
            "sequence would be cut again on each pass"
        )
    return tuple((key, *pair) for key, pair in seen.get("inputs", {}).items())


def _tensor_parallel(layer: nn.Module, attention: str, head_dim: int | None) -> dict:
    """The generic plan's rows for the modules this layer has; q/k norms of one head's width per head."""
    present = {name for name, _ in layer.named_modules()}
    plan = {path: style for path, style in DECODER.tensor_parallel.items() if path in present}
    for norm in ("q_norm", "k_norm"):
        module = getattr(getattr(layer, attention), norm, None)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and head_dim is not None and weight.shape[-1] == head_dim:
            plan[f"{attention}.{norm}"] = "per_head"
    return plan if "self_attn.q_proj" in plan else {}


def _config_value(config, name: str):
    """``config.<name>``, or None where it is missing or varies per layer (Gemma4 raises on reading it)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 -- transformers' per-layer attributes raise their own error types
        return None


def derive_layout(model: nn.Module) -> Layout:
    """The layout of ``model`` read off the model; a :class:`LayoutError` naming what cp cannot serve."""
    config, get_decoder = getattr(model, "config", None), getattr(model, "get_decoder", None)
    if config is None or get_decoder is None:
        raise LayoutError("it is not a transformers model (no config, no get_decoder)")
    decoder = get_decoder()
    decoder_path = _path_of(model, decoder)
    inner, layers = _decoder_layers(decoder, getattr(config, "num_hidden_layers", None))
    layers_path = _join(decoder_path, inner)
    attention = _attention_name(layers, layers_path)
    mixers = _token_mixers(layers, layers_path)
    if mixers:
        more = f" ({len(mixers) - 1} more such modules)" if len(mixers) > 1 else ""
        raise LayoutError(
            f"{mixers[0]}: it mixes tokens along the sequence outside the attention function, where each cp "
            f"rank would see its own slice only{more}"
        )
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise LayoutError(f"{type(config).__name__} has no num_attention_heads")
    kv_heads = (
        "num_key_value_heads" if isinstance(getattr(config, "num_key_value_heads", None), int) else None
    )
    width = "intermediate_size" if isinstance(getattr(config, "intermediate_size", None), int) else None
    head_dim = (
        _config_value(config, "head_dim") or (_config_value(config, "hidden_size") or 0) // heads or None
    )
    plan = _tensor_parallel(layers[0], attention, head_dim)
    return replace(
        DECODER,
        name=f"derived:{config.model_type}",
        model_types=(config.model_type,),
        decoder=decoder_path,
        decoder_layers=layers_path,
        attention=attention,
        final_norm=_final_norm(decoder, decoder_path, layers_path),
        kv_heads=kv_heads,
        mlp_width=width,
        layer_inputs=_recorded_inputs(model, layers, layers_path),
        head_transforms=tuple(name for name in HEAD_TRANSFORMS if getattr(config, name, None)),
        tensor_parallel=plan,
        tensor_parallel_inputs=tuple(p for p in DECODER.tensor_parallel_inputs if hasattr(layers[0], p))
        if plan
        else (),
        per_head_params=_per_head_params([getattr(layer, attention) for layer in layers], heads),
    )
