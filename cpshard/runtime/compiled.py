"""``make_cp_forward(model, compile=True)``: each decoder layer's forward compiled, as large-scale training
compiles (one ``torch.compile`` per layer, one graph shared by all layers of a class).

Only ``forward`` is compiled, never the module call around it: the hooks stay eager, so the cut, the call
and the channel a layer's collectives run on are resolved before the compiled code starts (see
:mod:`cpshard.comm.channel`), and nothing inside a layer breaks the graph.
"""

from __future__ import annotations

from functools import partial
from types import MethodType

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer


def compile_options(compile) -> dict:
    """``torch.compile``'s keyword arguments for ``make_cp_forward``'s ``compile``: True (inductor), or a
    backend (its name, such as ``"aot_eager"``, or a backend callable)."""
    if compile is True:
        return {}
    if isinstance(compile, str) or callable(compile):
        return {"backend": compile}
    raise ValueError(
        f"compile={compile!r}: give True (inductor) or a torch.compile backend (a name or callable)"
    )


def check_compiled_parallelism(tp: int, ep: int) -> None:
    """Compiled layers run cp (and data parallelism) only: the tensor- and expert-parallel hooks read the
    running call, which compiled code cannot."""
    if max(tp, ep) > 1:
        raise ValueError(
            f"compile=True runs cp and data parallelism only, not tp={tp}, ep={ep}: the tensor- and "
            "expert-parallel pieces read the running call, which a compiled layer cannot; use compile=False"
        )


def _checkpointing(forward):
    """``forward`` under the layer's activation checkpointing, as transformers' ``GradientCheckpointingLayer``
    runs its own: the checkpoint stays eager around the compiled forward (compiled code holds no checkpoint
    of cpshard's collectives), and the recompute runs the compiled forward again with the same arguments."""

    def checkpointed(self, *args, **kwargs):
        if not (getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled()):
            return forward(self, *args, **kwargs)
        kwargs = {**kwargs, "use_cache": False} if kwargs.get("use_cache") else kwargs
        if not getattr(self, "_can_checkpoint_with_cache", False):  # the replay must not write a cache again
            kwargs = {
                **kwargs,
                **{key: None for key in ("cache", "layer_past") if kwargs.get(key) is not None},
            }
        return self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)

    return checkpointed


def compiled_forward(kind: type, options: dict):
    """The compiled forward of a layer class: transformers' checkpointing wrapper, if the class has one,
    kept eager around its compiled inner forward."""
    inner = getattr(kind.forward, "__wrapped__", None)
    if isinstance(kind, type) and issubclass(kind, GradientCheckpointingLayer) and inner is not None:
        return _checkpointing(torch.compile(inner, **options))
    return torch.compile(kind.forward, **options)


def compile_layers(layers: nn.ModuleList, options: dict) -> None:
    """Each layer's forward compiled (once per layer class), bound to the layer as a method, so a
    ``copy.deepcopy`` of the model binds its own layers."""
    compiled = {}
    for layer in layers:
        kind = type(layer)
        if kind not in compiled:
            compiled[kind] = compiled_forward(kind, options)
        layer.forward = MethodType(compiled[kind], layer)
