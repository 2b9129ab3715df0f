"""The random streams a cp call draws from.

A model in training mode draws dropout masks (and MoE routers their jitter) from torch's default
generators, which the ranks hold in the same state (they are seeded alike, as the same weights ask).
Each rank runs its own slice of the sequence through the same shapes, so with one stream everywhere
the rank that holds tokens ``0 .. L/cp`` and the one that holds ``L/cp .. L`` would drop the same
positions of their slices (and, under Ulysses, every head group would drop alike): correlated dropout,
which one process never draws. Within a call each cp rank draws from a stream of its own, seeded by one
draw from the caller's stream (the same draw on every rank, so the caller's stream stays in step across
the ranks) plus the rank's place on the cp axis: the masks are independent, as one process's are,
though not one process's masks (no cp run can draw those). Tensor-parallel ranks share their stream
(their replicated activations must drop alike), and data-parallel groups keep theirs, as under DDP.
A checkpointed layer replays its draws in the backward: torch's checkpoint stashes the state it ran with.

What cpshard runs to learn about a model (the layout's derivation, the probe) draws from forked streams,
so the caller's next step draws what it would have drawn without it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def _accelerator(model: nn.Module) -> torch.device | None:
    """The accelerator ``model``'s parameters are on, with its index; None on the CPU (or the meta device,
    where cpshard check plans: neither has a stream of its own)."""
    device = next(model.parameters(), torch.empty(0)).device
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if current is None or device.type != current.type:
        return None
    return (
        device
        if device.index is not None
        else torch.device(device.type, torch.accelerator.current_device_index())
    )


def _forked(device: torch.device | None):
    """The CPU's random stream and that of the accelerator ``device`` (None: the CPU's alone) as they were,
    once the block is left."""
    devices, device_type = ([], "cuda") if device is None else ([device.index], device.type)
    return torch.random.fork_rng(devices=devices, device_type=device_type)


def forked_streams(model: nn.Module):
    """The CPU's random stream and that of ``model``'s accelerator as they were, once the block is left."""
    return _forked(_accelerator(model))


@contextmanager
def rank_stream(model: nn.Module, rank: int, ranks: int):
    """Inside the block, a model with any module in training mode (a frozen model with one part training, or
    dropout left on at inference) on cp rank ``rank`` of ``ranks`` draws from a stream of the rank's own; the
    caller's streams move by one draw, alike on every rank."""
    if ranks == 1 or not any(module.training for module in model.modules()):
        yield
        return
    seed = int(torch.randint(0, 1 << 62, (1,))) + rank
    device = _accelerator(model)
    with _forked(device):
        torch.default_generator.manual_seed(seed)
        if device is not None:  # the model's device, which need not be the current one
            with torch.accelerator.device_index(device.index):
                torch.get_device_module(device.type).manual_seed(seed)
        yield
