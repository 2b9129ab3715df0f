"""Mixed precision (``torch.autocast``) at the edges of cpshard's own computations.

Under autocast, one process runs each of the model's matmuls in the autocast type (its inputs cast, the
gradients cast back through the casts) and everything else in the tensors' own types. Where cpshard computes
in place of a model's op (the LM head with its loss, the ring in place of the attention function), it casts
that op's inputs as autocast would (:func:`autocast_inputs`, autograd-tracked) and computes inside with
autocast off (:func:`own_precision`): a half-type computation, as for a model cast to that type, whatever
autocast state its forward and backward run in (on a CPU the backward runs in the caller's thread, under
the caller's autocast; on a GPU in autograd's own).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager

import torch

#: the device types whose autocast cpshard's computations turn off inside
DEVICE_TYPES = ("cpu", "cuda")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The type autocast casts a matmul's inputs to on ``device_type`` now, None where it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def autocast_inputs(*tensors):
    """``tensors`` as an autocast-listed op (a matmul) would take them: a floating tensor other than float64
    cast to the autocast type of its device where autocast is on there; None stays None."""
    return tuple(_cast(tensor) for tensor in tensors)


def _cast(tensor):
    if tensor is None or not tensor.is_floating_point() or tensor.dtype == torch.float64:
        return tensor
    dtype = autocast_dtype(tensor.device.type)
    return tensor if dtype is None else tensor.to(dtype)


@contextmanager
def autocast_off():
    """Autocast off on every device type where it is on (nothing to do elsewhere)."""
    with ExitStack() as stack:
        for device_type in DEVICE_TYPES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def own_precision(method):
    """``method`` (an autograd Function's forward or backward, a custom op's body) run with autocast off: it
    computes in its inputs' own types."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with autocast_off():
            return method(*args, **kwargs)

    return run
