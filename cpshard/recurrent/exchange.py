"""State passing's one exchange: every rank's fixed-size fp32 summary, all-gathered over cp.

Its backward reduce-scatters every rank's gradient of every summary back to its rank. Each caller says
the analytic size of its summary (from its kernel's input shapes), which the exchange declares as the
optimum :func:`cpshard.debug.trace_comms` sets beside what ran.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpshard.comm.collectives import all_gather_shards
from cpshard.comm.record import expect


def gathered_summaries(parts: tuple[torch.Tensor, ...], group, path: str, nbytes: int) -> list[tuple]:
    """Every rank's ``parts`` (fp32; the same shapes on every rank), in rank order, by one all-gather;
    ``nbytes``: the analytic size of one rank's ``parts``; ``path``: the module and slot exchanging."""
    size = dist.get_world_size(group)
    module = path.partition(" ")[0]
    expect(module, "all_gather", "forward", 1, nbytes)
    expect(module, "reduce_scatter", "backward", 1, size * nbytes)
    mine = torch.cat([part.float().flatten() for part in parts])
    every = all_gather_shards([mine[None]], [size], group, f"{path} state")[0]
    sizes = [part.numel() for part in parts]
    return [
        tuple(flat.view_as(part) for flat, part in zip(row.split(sizes), parts, strict=True)) for row in every
    ]
