"""RWKV (v4) under cp: the token shifts with a halo of one token, the WKV recurrence by state passing.

Each block mixes tokens in two places, both inline: the token shift of its time mixing and of its channel
mixing (``time_shift``, an ``nn.ZeroPad2d`` that moves the sequence one step, the first position zero), and
the WKV recurrence of its time mixing (``rwkv_linear_attention``, a function of the model's module that
keeps ``num``, ``den`` and a running max ``m`` per channel: the true state ``num e^m`` decays by ``e^w``
per token, ``w = -exp(time_decay)``, and gains ``e^{k_t} v_t``; its outputs are a ratio, whatever ``m``).
Under cp:

- a forward hook on each token shift puts the previous rank's last position first
  (:func:`~cpshard.recurrent.halo.with_halo`, one token each way);
- the function is shadowed in the model's module by :class:`WKV`, which inside a cp call runs the model's own
  function from a zero state for the slice's final state, all-gathers those (fp32, ``B x C x 3``), folds those
  before this rank (:func:`~cpshard.recurrent.affine.stabilised_fold`: the true state carried ``e^{w T}``,
  kept in the same stabilised form) and runs the model's function again from the folded state for the outputs.
  Outside a cp call it is the model's function.

Generation carries the states cpshard's pieces see (the model's own ``state`` list is not used: cp runs it
with ``use_cache=False``): a prefill leaves each block's WKV state after the prompt's last token and each
token shift's last input in the cache, whole on every rank (one all-reduce each, from the rank that holds
that token); a decode step continues them, every rank alike, as the model's one-token path does.

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

import importlib
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import active_decode, split_call
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.layouts.layout import RWKV
from cpshard.recurrent.affine import stabilised_fold
from cpshard.recurrent.exchange import gathered_summaries
from cpshard.recurrent.halo import declare_halo, with_halo
from cpshard.recurrent.slot import carried_state, cp_group, handed_on, sink_state

MODULE = "transformers.models.rwkv.modeling_rwkv"
#: what the shadowed function and the token shifts' hooks were written against in transformers 5.25.0
WRITTEN_AGAINST = written_against(__name__)
#: the running max a zero state starts from, as the model's function has it
NO_STATE = -1e38


def check_rwkv_unchanged() -> None:
    module_name, pieces = WRITTEN_AGAINST
    if isinstance(importlib.import_module(module_name).rwkv_linear_attention, WKV):  # checked, then shadowed
        pieces = {name: code for name, code in pieces.items() if name != "rwkv_linear_attention"}
    check_written_for(f"{RWKV} (its token shifts and WKV recurrence served by cpshard)", module_name, pieces)


class WKV:
    """``rwkv_linear_attention`` as cpshard shadows it in the model's module (see the module's docstring);
    ``active``: the path of the time mixing running now (its pre-hook sets it), which names the exchange."""

    def __init__(self, original):
        self.original, self.active = original, None

    def __call__(self, time_decay, time_first, key, value, state=None, return_state=False):
        call = split_call()
        if call is None and (step := active_decode()) is not None:
            return self.decode(step, time_decay, time_first, key, value, return_state)
        if call is None:
            return self.original(time_decay, time_first, key, value, state=state, return_state=return_state)
        if state is not None or call.recurrent == "head_split":
            raise ValueError(
                f"{self.active}: cp serves RWKV's WKV recurrence by state passing, from no state (pass "
                "use_cache=False, recurrent='state_passing' or 'auto')"
            )
        group = cp_group(call)
        _, local = self.original(time_decay, time_first, key, value, return_state=True)
        batch, length, channels = key.shape
        every = gathered_summaries(tuple(local), group, f"{self.active} wkv", batch * channels * 3 * 4)
        decay = -torch.exp(time_decay.float()) * length
        states = [tuple(torch.full_like(local[0], fill) for fill in (0.0, 0.0, NO_STATE))]
        for summary in every:
            states.append(stabilised_fold(states[-1], summary, decay))
        rank = dist.get_rank(group)
        # every rank's outputs read every summary, so that every rank runs the gather's backward
        incoming = [part + 0 * last for part, last in zip(states[rank], states[-1], strict=True)]
        output, final = self.original(time_decay, time_first, key, value, state=incoming, return_state=True)
        if call.state_sink is not None:  # a prefill: the state after the prompt's last token is carried on
            parts = (time_decay, time_first, key, value)
            sink_state(call, f"{self.active} wkv", self.state_at(call, parts, states[rank], final))
        return output, (final if return_state else None)

    def state_at(self, call, parts: tuple, incoming: list, final: list) -> torch.Tensor:
        """``[3, B, C]``: the state after the prompt's last token, on every rank (the rank that holds it runs
        its slice up to there from its incoming state)."""
        time_decay, time_first, key, value = parts
        held = key.shape[1]

        def after(end: int) -> torch.Tensor:
            if end == held:
                return torch.stack(final)
            cut = self.original(
                time_decay, time_first, key[:, :end], value[:, :end], incoming, return_state=True
            )
            return torch.stack(cut[1])

        like = torch.stack(incoming)
        return handed_on(call, held, after, like, self.active, f"{self.active} wkv final state")

    def decode(self, step, time_decay, time_first, key, value, return_state):
        """One token per row from the carried state (the model's own function, every rank alike)."""
        path = f"{self.active} wkv"
        carried = tuple(carried_state(step, path).unbind(0))
        output, new = self.original(time_decay, time_first, key, value, state=carried, return_state=True)
        step.new_states[path] = torch.stack(new)
        return output, (new if return_state else None)


def shadowed_wkv() -> WKV:
    """The module's WKV function shadowed by cpshard (once per process: idempotent)."""
    module = importlib.import_module(MODULE)
    current = module.rwkv_linear_attention
    if not isinstance(current, WKV):
        current = module.rwkv_linear_attention = WKV(current)
    return current


def _entered(wkv: WKV, path: str, mixer, args, kwargs):
    wkv.active = path


def _shifted(path: str, shift, args, output):
    """The token shift's output with the previous rank's last position first (zeros on rank 0); in a
    prefill the prompt's last input is carried on, in a decode step the carried one comes first."""
    call, key = split_call(), f"{path} time_shift"
    if call is None and (step := active_decode()) is not None:
        step.new_states[key] = args[0][:, -1]
        return torch.cat([carried_state(step, key)[:, None], args[0][:, :-1]], dim=1)
    if call is None:
        return None
    hidden, group = args[0].transpose(1, 2), cp_group(call)  # [B, C, T]: the halo's sequence dim last
    declare_halo(path, hidden[..., :1], group)
    if call.state_sink is not None:
        inputs = args[0]  # [B, T, C]
        last = handed_on(
            call, inputs.shape[1], lambda end: inputs[:, end - 1], inputs[:, 0], path, f"{key} last input"
        )
        sink_state(call, key, last)
    return with_halo(hidden, 1, group, f"{path} time_shift halo")[..., :-1].transpose(1, 2)


def rwkv_hooks(layer: nn.Module, layer_path: str, mixer: str) -> list[Hook]:
    """Shadow the WKV function (once); the hooks of one block: its time mixing names the exchange, each
    token shift (time and channel mixing) takes its halo."""
    rescale = layer.get_submodule(mixer).config.rescale_every
    if rescale > 0:
        raise ValueError(
            f"{layer_path}: RWKV with rescale_every={rescale} divides its weights in place whenever it runs "
            "in eval mode (a guard against fp16 overflow in inference), which cp's parameters do not take "
            "and its probe runs in: set model.config.rescale_every = 0 (training mode never rescales)"
        )
    wkv = shadowed_wkv()
    hooks = [Hook(layer.get_submodule(mixer), partial(_entered, wkv, f"{layer_path}.{mixer}"), pre=True)]
    for name, module in layer.named_modules():
        if name.endswith("time_shift"):
            owner = f"{layer_path}.{name.rpartition('.')[0]}"
            hooks.append(Hook(module, partial(_shifted, owner), pre=False))
    return hooks
