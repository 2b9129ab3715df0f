"""What one forward of a model on a short sequence shows, for deriving its layout
(:mod:`cpshard.layouts.derive`): the per-position inputs each decoder layer receives (by name or by
position; a value one layer returns and the next receives is carried, not cut), the order in which the
decoder's own children ran, whether the loss reads ``labels`` as already shifted (BART's causal LMs), and
whether the decoder reshapes its output to the input's length (GPT-2). The residual stream may hold several
copies of each token (DeepSeek-V4's hyper-connections ``[b, s, n, d]``, Gemma 3n's AltUp ``[n, b, s, d]``):
its spec says where the sequence sits; the mixing across copies is per token, so the cut stays a slice.
Layers entered more than once per forward (Dory's recurrent section) are looped: the stream is cut at its
first entry only. Layers of the same kind run from another list beside the decoder's (HRM's H and L stacks)
are recorded for a decoder whose code cpshard has read (:data:`~cpshard.layouts.layout.ENTERED_DECODERS`:
cut where the sequence enters it). Refused here, naming the layer: a residual stream whose sequence dim
cannot be told, such layers beside any other decoder, a model that does not run on token ids and labels
alone. No gradients.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cpshard.layouts.errors import LayoutError
from cpshard.layouts.family_attention import PER_KEY_INPUTS
from cpshard.layouts.layout import ENTERED_DECODERS, specs
from cpshard.layouts.structure import text_config

#: the sequence length of the recording run: odd and prime, so no other size is mistaken for it
PROBE_LENGTH = 13


def _sequence_spec(tensor: torch.Tensor) -> tuple | None:
    """(before, after) specs for a per-position tensor: batch first, one dimension of the sequence's
    length (dim 1 for rotary pairs and per-layer inputs, dim 2 for Beam's ``[b, 1, s, 1]`` query
    scaling), sliced over cp."""
    lengths = [i for i, size in enumerate(tensor.shape) if size == PROBE_LENGTH]
    if len(lengths) != 1 or lengths[0] == 0:
        return None
    names = [("s" if i == lengths[0] else f"x{i}") for i in range(1, tensor.dim())]
    return specs(" ".join(["b", *names]), " ".join(["b", *names]).replace(" s", " s@cp", 1))


def _stream_spec(hidden) -> tuple | None:
    """(before, after) specs for the residual stream the first layer receives: ``b s d`` (the generic
    decoder's, as it is), or with a dim of copies ``n`` wherever the model keeps it (``b s n d``,
    ``n b s d``), the probe's batch of one telling ``b`` from ``n``. None where they cannot be told."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (3, 4):
        return None
    if hidden.dim() == 3:
        return specs("b s d", "b s@cp d")
    shape = list(hidden.shape[:-1])
    if shape.count(PROBE_LENGTH) != 1 or shape.count(1) != 1:
        return None
    names = " ".join(["s" if size == PROBE_LENGTH else "b" if size == 1 else "n" for size in shape] + ["d"])
    return specs(names, names.replace("s", "s@cp", 1))


def _parts(value) -> tuple:
    """The tensors of one layer argument: a rotary pair's two, or every pair's of a dict of them per rope
    type (DeepSeek-V4's ``{"main": ..., "compress": ...}``), cut alike."""
    if isinstance(value, dict):
        return tuple(part for inner in value.values() for part in _parts(inner))
    return value if isinstance(value, tuple) else (value,)


def _layer_arguments(layer: nn.Module, args: tuple, kwargs: dict) -> dict:
    """A decoder layer's arguments by name, positional ones included (Gemma4 passes its per-layer input
    second, unnamed)."""
    names = list(inspect.signature(layer.forward).parameters)
    return {**dict(zip(names, args)), **kwargs}


def probe_ids(model: nn.Module) -> torch.Tensor:
    """``[1, PROBE_LENGTH]`` token ids inside the vocabulary, clear of the usual special ids."""
    ids = torch.arange(PROBE_LENGTH).remainder(max(getattr(text_config(model), "vocab_size", 2) - 3, 1)) + 3
    return ids.unsqueeze(0).to(next(model.parameters()).device)


@dataclass(frozen=True)
class Recording:
    """What one forward on a short sequence showed: the per-position inputs of the layers, and the order
    in which the decoder's own children ran."""

    layer_inputs: tuple
    children: tuple[str, ...]
    labels_shifted: bool
    #: the residual stream's (before, after) specs
    hidden: tuple = specs("b s d", "b s@cp d")
    #: some layer ran more than once (looped layers)
    looped: bool = False
    #: layers of the same kind ran from another list beside the decoder's (HRM's second stack), by path
    beside: tuple[str, ...] = ()


def record_forward(model: nn.Module, decoder: nn.Module, layers: nn.ModuleList, layers_path: str, top: str):
    """Run the model once on a short sequence and read off what each layer receives per position; ``top``
    is the decoder's child that holds the layers. A value a layer returns and the next receives (ZAYA's
    router states) is carried on each rank's slice, not an input to cut."""
    seen, calls, children, produced = {}, [], [], {}  # produced: by id, held so that no id is reused

    def record(module, args, kwargs):
        calls.append(module)
        children.append(top)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if module is layers[0]:
            seen["hidden"] = _stream_spec(hidden) or (
                list(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            )
        named = _layer_arguments(module, args, kwargs)
        for key, value in list(named.items())[1:]:
            parts = _parts(value)
            if "mask" in key or key in PER_KEY_INPUTS or not all(isinstance(v, torch.Tensor) for v in parts):
                continue
            if any(id(v) in produced for v in parts):
                continue
            pair = _sequence_spec(parts[0])
            if pair is not None and all(_sequence_spec(v) == pair for v in parts):
                seen.setdefault("inputs", {})[key] = pair

    def carried(module, args, output):
        produced.update((id(v), v) for v in (output if isinstance(output, tuple) else (output,)))

    strays = []  # layers of the same kind run from outside ``layers``
    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    handles += [
        stray.register_forward_pre_hook(lambda *_, path=path: strays.append(path))
        for path, stray in _layers_beside(model, layers)
    ]
    handles += [layer.register_forward_hook(carried) for layer in layers]
    handles += [
        child.register_forward_hook(lambda *_, name=name: children.append(name))
        for name, child in decoder.named_children()
    ]
    ids = probe_ids(model)
    try:
        with torch.no_grad():
            output = model(input_ids=ids, labels=ids, use_cache=False)
    except LayoutError:
        raise
    except Exception as error:  # noqa: BLE001 -- whatever the model raises, cp cannot run it either
        raise LayoutError(
            f"{type(model).__name__} does not run on token ids and labels alone: its own forward, without "
            f"cp, raised {type(error).__name__}: {str(error)[:200]} (it needs other inputs, or does not "
            "support its dtype or a config field as set); cpshard runs a causal LM on those"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    if not isinstance(seen["hidden"], tuple):
        raise LayoutError(
            f"{layers_path}.0 receives a residual stream of shape {seen['hidden']}, not [batch, sequence, "
            "hidden] with at most one dim of copies: cpshard cannot tell which dim to cut"
        )
    if strays and type(decoder).__name__ not in ENTERED_DECODERS:
        raise LayoutError(
            f"{strays[0]} ({type(layers[0]).__name__}) runs beside {layers_path} in one forward: the decoder "
            "passes the stream through more than one list of layers, and what its own loop keeps and adds "
            "between them is code cpshard has not read (it cuts such a decoder at its entry only where it "
            f"knows every op outside attention is per position: {', '.join(sorted(ENTERED_DECODERS))})"
        )
    inputs = tuple((key, *pair) for key, pair in seen.get("inputs", {}).items())
    labels_shifted = _reads_labels_shifted(output, ids)
    looped = len({id(layer) for layer in calls}) < len(calls)
    beside = tuple(dict.fromkeys(strays))
    return Recording(inputs, tuple(children), labels_shifted, seen["hidden"], looped=looped, beside=beside)


def _layers_beside(model: nn.Module, layers: nn.ModuleList) -> list[tuple[str, nn.Module]]:
    """The model's modules of the first layer's class outside ``layers`` (HRM's second stack), by path; not
    those inside a layer (Zamba's hybrid layers hold a Mamba layer)."""
    kind, own = type(layers[0]), {id(module) for module in layers.modules()}
    return [(path, m) for path, m in model.named_modules() if type(m) is kind and id(m) not in own]


def restores_length(model: nn.Module, final: nn.Module, runs: int = 1) -> bool:
    """Whether the model fails when its final hidden states are one position short, as a cp rank's are:
    the decoder reshapes them to the input's length (GPT-2's ``view(output_shape)``). ``final`` runs
    ``runs`` times per forward (Dory's norm, between loops too): only its last output is the final one."""
    ran = []

    def short(module, args, output):
        ran.append(module)
        if len(ran) != runs:
            return None
        if isinstance(output, tuple | list):  # a post-norm layer's outputs (OpenAI GPT's blocks: a list)
            return type(output)((output[0][:, :-1], *output[1:]))
        return output[:, :-1] if isinstance(output, torch.Tensor) else None

    handle = final.register_forward_hook(short)
    try:
        with torch.no_grad():
            model(input_ids=probe_ids(model), use_cache=False)
    except RuntimeError:
        return True
    finally:
        handle.remove()
    return False


def _reads_labels_shifted(output, ids: torch.Tensor) -> bool:
    """Whether the model's loss on ``labels=ids`` is the cross-entropy of each position's logits against
    its own token (labels taken as already shifted) rather than against the next one. A loss in the
    model's dtype is that cross-entropy to its rounding (BART's in bf16: 5.25 for 5.2579)."""
    logits, loss = getattr(output, "logits", None), getattr(output, "loss", None)
    if not isinstance(logits, torch.Tensor) or not isinstance(loss, torch.Tensor):
        return False
    flat = logits.float().flatten(0, 1)
    aligned = F.cross_entropy(flat, ids.flatten())
    shifted = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    rounding = max(1e-5, 2 * torch.finfo(loss.dtype).eps)
    closer = (loss.float() - aligned).abs() < (loss.float() - shifted).abs()
    return bool(closer and torch.isclose(loss.float(), aligned, rtol=rounding))
