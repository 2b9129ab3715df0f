"""One kernel slot of a recurrent mixer, taken by cpshard: what every served slot shares.

transformers 5.25 calls a mixer's kernels through slots the kernels package keeps per module
(``module._kernel_funcs``, filled by ``@use_kernelized_func``). cpshard puts a :class:`Slot` into each it
serves: inside a cp call it serves this rank's slice, in a cp decode step it continues the carried state,
outside both it calls the model's own function, so the model is unchanged outside cp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpshard.call import CallPlan, active_decode, split_call
from cpshard.comm.collectives import sum_over_group
from cpshard.comm.record import expect
from cpshard.comm.redistribute import redistribute
from cpshard.spec.notation import Spec


class Slot:
    """One slot of one mixer, taken by cpshard. ``serve`` runs inside a cp call, ``decode`` in a cp decode
    step; outside both, the model's own function (``original``) runs."""

    def __init__(self, original, module: str, name: str, siblings: dict):
        self.original, self.module, self.path = original, module, f"{module} {name}"
        #: the mixer's kernel slots, where a decode finds the model's own one-token update
        self.siblings = siblings

    def forward(self, *args, **kwargs):
        if not isinstance(self, Slot):  # the kernels package calls slots so under torch.compile
            raise RuntimeError(
                "cpshard's linear-attention slots do not run under torch.compile; compile a model that "
                "no cp_forward has prepared (or run this one eagerly)"
            )
        call = split_call()
        if call is not None:
            return self.serve(call, *args, **kwargs)
        step = active_decode()
        if step is not None:
            return self.decode(step, *args, **kwargs)
        return self.original(*args, **kwargs)

    __call__ = forward

    def serve(self, call: CallPlan, *args, **kwargs):
        raise NotImplementedError

    def decode(self, step, *args, **kwargs):
        raise NotImplementedError

    def sink(self, call: CallPlan, state: torch.Tensor) -> None:
        sink_state(call, self.path, state)

    def carried(self, step) -> torch.Tensor:
        return carried_state(step, self.path)


def sink_state(call: CallPlan, path: str, state: torch.Tensor) -> None:
    """Leave the state that ``path`` (a slot, or a hooked piece) hands on after the prompt in a prefill's
    sink (once per forward)."""
    if path in call.state_sink:
        raise ValueError(f"{path} ran twice in one forward; cp generation carries one state per slot, call")
    call.state_sink[path] = state


def carried_state(step, path: str) -> torch.Tensor:
    """The state a decode step hands ``path``, from the cache of the prefill or the last step."""
    if path not in step.states:
        raise ValueError(
            f"{path}: the cache holds no state for this layer; give cp_decode the cache that cp_prefill "
            "(or the last cp_decode) of this model returned"
        )
    return step.states[path]


def handed_on(call: CallPlan, held: int, after, like: torch.Tensor, module: str, name: str) -> torch.Tensor:
    """What hands on after the prompt's last position (``call.length - 1``, before the positions cp padded
    past it), on every rank: ``after(end)`` on the rank that holds that position, ``end`` the number of its
    ``held`` positions up to it; one all-reduce (declared for ``module``), the other ranks giving zeros
    shaped ``like``."""
    end = call.length - dist.get_rank(cp_group(call)) * held
    value = after(end) if 0 < end <= held else torch.zeros_like(like)
    expect(module, "all_reduce", "forward", 1, tensor_bytes(value))
    return sum_over_group(value, cp_group(call), name=name)


def last_inputs(widened: torch.Tensor, width: int, call, module: str, name: str) -> torch.Tensor:
    """``[..., width]``: the convolution's inputs at the prompt's last ``width`` real positions (zeros
    before the first), which the rank holding its last position finds in its halo-widened slice (counted
    from the halo's first position)."""
    held, like = widened.shape[-1] - width, widened[..., :width]
    return handed_on(call, held, lambda end: widened[..., end : end + width], like, module, name)


def cp_group(call: CallPlan):
    return call.mesh.get_group("cp")


def tensor_bytes(x: torch.Tensor) -> int:
    """What ``x`` puts into a collective: its elements in its dtype."""
    return x.numel() * x.element_size()


#: a padding mask ``[B, L]``, whole and as each rank keeps it
_MASK = (Spec("b s"), Spec("b s@cp"))


def cut_to_rank(mask: torch.Tensor, call: CallPlan) -> torch.Tensor:
    """The whole sequence's padding mask ``[B, L]`` cut to this rank's positions."""
    return redistribute(mask, *_MASK, call.mesh)
