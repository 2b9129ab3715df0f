"""Where a process group can carry a tensor.

cpshard's checks (the batch's fingerprint, the cp forward's agreement, the probe's verdict, a sampling
seed) build small rows on the CPU. A gloo group, or one made as ``"cpu:gloo,cuda:nccl"``, carries them
there; an NCCL-only group (``init_process_group("nccl")``, as torchrun scripts and accelerate make it)
has no backend for a CPU tensor and would raise inside the collective. Such a row travels on the
current accelerator instead, and comes back to where it was.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def backend_device_types(backend: str) -> tuple[str, ...]:
    """The device types a backend string serves: its ``device:backend`` pairs (``"cpu:gloo,cuda:nccl"``),
    else what torch registers for the backend (``"nccl"`` -> cuda); ``()`` for one torch does not know (and
    for ``"undefined"``, what a group made without a backend name reports)."""
    if ":" in backend:
        return tuple(pair.split(":")[0].strip() for pair in backend.split(","))
    return tuple(dist.Backend.backend_capability.get(backend.lower(), ()))


@torch.compiler.disable  # a process group is opaque to dynamo: reading its devices inside a graph is an error
def served_device_types(group) -> tuple[str, ...]:
    """The device types ``group`` carries: as the group reports them (what torch's own object collectives
    ask; ``init_process_group()`` without a backend name makes one that carries the accelerator's alone and
    whose backend string is "undefined"), else as its backend string says."""
    reported = getattr(group, "_device_types", None)
    if reported:
        return tuple(dict.fromkeys(device.type for device in reported))
    return backend_device_types(dist.get_backend(group))


def carrying_device_type(served: tuple[str, ...], device_type: str) -> str:
    """The device type a tensor on ``device_type`` travels on through a group serving ``served``: its own
    where served (or where the backend's devices are unknown), else the CPU where served, else the first
    served one."""
    if not served or device_type in served:
        return device_type
    return "cpu" if "cpu" in served else served[0]


def carried(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` on a device ``group`` carries (itself where it already is on one)."""
    device_type = carrying_device_type(served_device_types(group), x.device.type)
    if device_type == x.device.type:
        return x
    if device_type == "cpu":
        return x.cpu()
    return x.to(torch.device(device_type, torch.accelerator.current_device_index()))
