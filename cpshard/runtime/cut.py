"""Where the sequence is cut: forward pre-hooks on the decoder layers.

Everything before the first layer (embeddings, rotary, the masks) runs on the whole sequence,
so masks stay exact; the first layer slices the residual stream, and every layer slices the
per-layer inputs it receives (each layer may get its own rotary pair). Slices need no
communication. The call's sequence order is part of the spec the cut goes to: under
``b s@cp:head_tail d`` rank r takes chunks r and 2P-1-r. Outside a cp call the hooks step aside.
"""

from __future__ import annotations

import inspect
import weakref
from functools import partial

import torch

from cpshard.call import TRACED_KEY, CallPlan, split_call
from cpshard.comm.redistribute import redistribute
from cpshard.comm.reorder import to_chunks
from cpshard.interfaces import Hook
from cpshard.layouts.layout import Layout


def _cut(value, before, after, call: CallPlan, once: bool = False):
    """``value``'s share of this rank; ``once``: a tensor cut before in this call gives the same cut
    (:func:`_cut_once`)."""
    if isinstance(value, dict):  # a rotary pair per rope type (DeepSeek-V4)
        return {key: _cut(v, before, after, call, once) for key, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_cut(v, before, after, call, once) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if once:
        return _cut_once(value, before, after, call)
    cut = redistribute(value, before, after.ordered("cp", call.order), call.mesh)
    return _fresh(cut, call.traced)


def _cut_once(value: torch.Tensor, before, after, call: CallPlan) -> torch.Tensor:
    """A per-layer input's cut, made once per call and tensor: transformers hands every layer the same
    rotary pair, and a cut per layer would be a copy per layer (:func:`_fresh`), each kept for that
    layer's backward. The tensor is known by a weak reference and its version: one freed (its id then
    another's) or changed in place is cut anew."""

    def make():
        return weakref.ref(value), _cut(value, before, after, call)

    version = None if value.is_inference() else value._version
    known, cut = call.shared(("layer input", id(value), version, before, after), make)
    return cut if known() is value else make()[1]


def _fresh(cut: torch.Tensor, traced: bool) -> torch.Tensor:
    """``cut`` in a storage of its own where it is a slice of the whole sequence (the layer saves it, for
    its norm or a checkpoint, and with it the whole would stay alive), which also puts it at offset 0;
    contiguous for a compiled layer, as every later layer's input is, so one graph serves all layers."""
    if type(cut) is torch.Tensor and cut.untyped_storage().nbytes() > cut.nbytes:
        return cut.clone(memory_format=torch.contiguous_format)
    return cut.contiguous() if traced else cut


@torch._dynamo.disable  # reads the running call; under cpshard's per-layer compile it runs before the layer
def _cut_layer_inputs(first: bool, names: tuple[str, ...], module, args, kwargs):
    """``names``: the layer's parameters in order, for inputs passed by position (Gemma4's per-layer
    input)."""
    call = split_call()
    if call is None:
        return None
    layout = call.layout
    if first and _enters_whole(args[0] if args else kwargs["hidden_states"], call):
        if args:
            args = (_cut(args[0], *layout.hidden, call), *args[1:])
        else:
            kwargs["hidden_states"] = _cut(kwargs["hidden_states"], *layout.hidden, call)
    for key, before, after in layout.layer_inputs:
        if kwargs.get(key) is not None:
            kwargs[key] = _cut(kwargs[key], before, after, call, once=True)
        elif key in names[1 : len(args)]:
            index = names.index(key)
            args = (*args[:index], _cut(args[index], before, after, call, once=True), *args[index + 1 :])
    if call.traced:
        _for_compiled_layer(module, args, kwargs, call)
    return args, kwargs


def _enters_whole(stream: torch.Tensor, call: CallPlan) -> bool:
    """Whether the residual stream comes into the first layer whole, to be cut: always, but in a looped
    layout only at its first entry; a later one brings the slice the layers gave back, cut already."""
    layout = call.layout
    return not layout.looped or stream.shape[layout.hidden[1].sharded_dim("cp")] == call.padded_length


@torch._dynamo.disable
def _cut_at_norm(module, args, kwargs):
    """In a looped layout the final norm may meet the stream before any layer (Dory without input layers
    normalizes the embeddings it adds back before every pass): it is cut there, so that what comes back is
    the slice."""
    call = split_call()
    if call is None or not args or not _enters_whole(args[0], call):
        return None
    return (_cut(args[0], *call.layout.hidden, call), *args[1:]), kwargs


def _for_compiled_layer(layer, args, kwargs, call: CallPlan) -> None:
    """What a compiled layer's attention needs, resolved out here (see :mod:`cpshard.comm.channel`); the
    sequence dims marked dynamic, so that the first compile serves every length."""
    kwargs[TRACED_KEY] = call.traced_for(layer.get_submodule(call.layout.attention))
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        if call.implementation == "ulysses":  # the keys past the length are cp padding
            mask = call.shared(("real keys", id(mask)), lambda: mask[..., : call.length].contiguous())
            kwargs["attention_mask"] = mask
        for dim in (-2, -1):
            torch._dynamo.maybe_mark_dynamic(mask, dim % mask.dim())
    stream = args[0] if args else kwargs["hidden_states"]
    if isinstance(stream, torch.Tensor):  # its sequence dim where the spec puts it (Gemma 3n's ``n b s d``)
        torch._dynamo.maybe_mark_dynamic(stream, call.layout.hidden[1].sharded_dim("cp"))
    cut = []
    for key, _, _ in call.layout.layer_inputs:
        value = kwargs.get(key)
        cut += value if isinstance(value, tuple) else [value]
    for value in cut:
        if isinstance(value, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(value, 1)


def _held_rows(call: CallPlan) -> int:
    return call.padded_length // call.cp_size


@torch._dynamo.disable
def _contiguous_again(module, args, output):
    """After the final norm (or a post-norm decoder's last layer): back to contiguous chunks, so logits
    are a plain ``Shard(1)``. Where the decoder reshapes its output to the input's length (GPT-2), the
    rows this rank holds come first in a tensor of that length, zeros after them; the head's
    hook (:func:`held_rows_only`) takes them out again."""
    call = split_call()
    if call is None or (call.order == "contiguous" and not call.layout.restores_length):
        return None
    several = isinstance(output, tuple | list)  # a layer's outputs (OpenAI GPT's blocks: a list)
    hidden = output[0] if several else output
    if call.order != "contiguous":
        group = call.mesh.get_group("cp")
        hidden = to_chunks(hidden, 1, call.order, call.padded_length, call.length, group, "undo order")
    if call.layout.restores_length:
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, call.padded_length - hidden.shape[1]))
    return type(output)((hidden, *output[1:])) if several else hidden


def held_rows_only(hidden: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds, where the decoder gave them in a tensor of the input's length
    (:func:`_contiguous_again`; ProphetNet's predict streams ``[B, n, L, D]``: the rows are the dim before the
    features); any other tensor as it is."""
    call = split_call()
    if call is None or not call.layout.restores_length or hidden.shape[-2] != call.padded_length:
        return hidden
    return hidden[..., : _held_rows(call), :]


@torch._dynamo.disable
def _head_input(module, args, kwargs):
    if not args:
        return None
    return (held_rows_only(args[0]), *args[1:]), kwargs


def cut_hooks(
    layers: torch.nn.ModuleList, final_norm: torch.nn.Module, head: torch.nn.Module, layout: Layout
) -> list[Hook]:
    """The cut on every decoder layer (the first also cuts the residual stream; in a looped layout, the
    final norm too where the stream meets it whole; none where the layout cuts at the decoder's entry),
    the order undone after the final norm (or the last layer), and the rows this rank holds taken at the
    LM ``head``."""
    cuts = [
        Hook(
            layer,
            partial(_cut_layer_inputs, index == 0, tuple(inspect.signature(layer.forward).parameters)),
            pre=True,
        )
        for index, layer in enumerate(layers)
        if not layout.cut_at_entry
    ]
    ends = [Hook(final_norm, _cut_at_norm, pre=True)] if layout.looped else []
    ends.append(Hook(final_norm, _contiguous_again, pre=False))
    return [*cuts, *ends, Hook(head, _head_input, pre=True)]
