"""DeepSeek-V4's compressed layers under cp: each rank pools the windows that end in its chunks, and the
ranks gather the pooled entries, not the tokens.

A compressor (CSA's, its indexer's, HCA's) pools each window of ``compress_rate`` tokens into one entry
(CSA's and the indexer's also weigh the previous window's first series, Ca). Under cp a window belongs to the
rank holding its last token; the tokens of its windows that lie before a chunk (fewer than a window, and for
CSA the previous window's besides) come from a halo: every rank hands on the last ``min(reach, chunk)``
tokens and gates of each of its chunks, in one all-gather (their gradients reduce-scattered back), which holds
the ``reach`` tokens before any chunk whatever the chunks' lengths (a chunk shorter than the reach hands on
all of it, and the one before it its own). The rank hands the model's compressor its windows' tokens, each
run of them led by the window before it where windows overlap: that window's entry is pooled and dropped, so
that the next one's overlap comes from the model's own code. Each window's rope position goes in the
``first_window_position`` the model adds to its windows' offsets (a tensor where a rank's windows are not one
run: head-tail and striped orders). The entries then gather in one all-gather, every rank's padded to the
most any rank pools, and come back in window order: each query's scores and block bias are one process's.

What each rank pools is :func:`window_plan`'s, a pure function of the sizes. Bytes a layer and rank: the
halo's ``chunks x min(reach, chunk)`` tokens (CSA and its indexer: ``reach = 2 rate - 1``; HCA: ``rate - 1``)
of ``kv + gate`` elements, and the entries' ``ceil(L / cp / rate)``-odd of ``head_dim`` (CSA, HCA) and
``index_head_dim`` (the indexer), not ``L / cp`` tokens of each; backward, the compressor's halo and entries'
gradients (the indexer's top-k is not differentiable: its tokens and entries are detached).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from cpshard.call import CallPlan
from cpshard.comm.collectives import gathered
from cpshard.spec.sequence import chunk_width, positions

#: the layer type whose windows overlap (CSA: each entry weighs the previous window's Ca series, for it and
#: its indexer); HCA's windows do not
OVERLAPPING = "compressed_sparse_attention"


class WindowPlan(NamedTuple):
    """What one rank pools of a compressor's windows (positions are the sequence's, rows the tensors')."""

    #: the rows of the rank's slice it hands on as its chunks' halo (the last of each chunk)
    tails: torch.Tensor
    #: the tokens it pools, as rows of ``[every rank's tails, in rank order; its own slice]``
    take: torch.Tensor
    #: where each pooled window starts, less its offset in the pooled run (the model adds those)
    first_positions: torch.Tensor
    #: the pooled windows whose entries are the rank's (the others only lend the next one their overlap)
    keep: torch.Tensor
    #: the most entries any rank keeps: each rank's, padded to this, gather
    slots: int
    #: each window's row among the gathered entries, in window order
    order: torch.Tensor


def _owned(start: int, width: int, rate: int, windows: int) -> torch.Tensor:
    """The windows (of the first ``windows``) whose last token lies in ``[start, start + width)``."""
    return torch.arange(min(windows, start // rate), min(windows, (start + width) // rate))


def _entry_order(starts: list[list[int]], width: int, rate: int, windows: int) -> tuple[int, torch.Tensor]:
    """The most windows a rank owns, and each window's row among the ranks' entries, each rank's padded to
    that many rows, in rank order."""
    owned = [torch.cat([_owned(start, width, rate, windows) for start in row]) for row in starts]
    slots = max(len(mine) for mine in owned)
    order = torch.empty(windows, dtype=torch.long)
    for rank, mine in enumerate(owned):
        order[mine] = rank * slots + torch.arange(len(mine))
    return slots, order


def window_plan(
    order: str, padded: int, size: int, rank: int, length: int, rate: int, overlap: bool
) -> WindowPlan:
    """Which windows of ``rate`` tokens of the sequence's first ``length`` (cp's padding and the tail short of
    a window make none) rank ``rank`` of ``size`` pools, and the tokens it needs from the others. Each rank
    holds equal chunks of ``padded`` tokens in ``order``; a window is the rank's whose chunk holds its last
    token; each chunk's halo is its last ``min(reach, chunk)`` tokens (``reach``: the most tokens a chunk's
    first window and, where windows ``overlap``, the window before it lie before the chunk)."""
    width, windows = chunk_width(order, padded, size), length // rate
    starts = [positions(order, padded, size, r)[::width].tolist() for r in range(size)]
    halo = min(width, (2 if overlap else 1) * rate - 1)
    # the row of each position among every rank's gathered halo (its chunks' last tokens, in rank order)
    halo_positions = torch.cat(
        [torch.arange(start + width - halo, start + width) for row in starts for start in row]
    )
    halo_row = torch.full((padded,), -1, dtype=torch.long)
    halo_row[halo_positions] = torch.arange(len(halo_positions))
    take, first, keep, pooled = [], [], [], 0
    for index, start in enumerate(starts[rank]):
        owned = _owned(start, width, rate, windows)
        if not len(owned):
            continue
        lead = int(overlap and owned[0] > 0)  # the window before, for its Ca series alone
        run = torch.arange(owned[0] - lead, owned[-1] + 1)
        tokens = torch.arange(run[0] * rate, (run[-1] + 1) * rate)
        local = len(halo_positions) + index * width + tokens - start
        take.append(torch.where(tokens < start, halo_row[tokens], local))
        first.append((run - torch.arange(pooled, pooled + len(run))) * rate)
        keep.append(torch.arange(pooled + lead, pooled + len(run)))
        pooled += len(run)
    tails = torch.cat(
        [index * width + torch.arange(width - halo, width) for index in range(len(starts[rank]))]
    )
    empty = [torch.zeros(0, dtype=torch.long)]
    take, first, keep = (torch.cat(parts or empty) for parts in (take, first, keep))
    return WindowPlan(tails, take, first, keep, *_entry_order(starts, width, rate, windows))


class CompressedWindows:
    """The cache layer a DeepSeek-V4 compressed layer's compressor and indexer read under cp
    (``cache.layers[layer_idx]``): the model's ``DeepseekV4HCACache`` / ``DeepseekV4CSACache`` methods as a
    cache of no past serves them, for the windows :func:`window_plan` gives this rank, their entries gathered
    whole."""

    def __init__(self, call: CallPlan, path: str, module: nn.Module):
        self.call, self.path, self.compressor, self.halos = call, path, module.compressor, {}
        self.rate = module.compressor.compress_rate
        self.overlap = module.layer_type == OVERLAPPING
        rank, size = call.mesh.get_local_rank("cp"), call.cp_size
        key = ("compressed windows", self.rate, self.overlap)
        self.plan = call.shared(
            key,
            lambda: window_plan(
                call.order, call.padded_length, size, rank, call.length, self.rate, self.overlap
            ),
        )

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        """The tokens and gates ``[B, L/cp, d]`` of the compressor (``name`` "compressor") or its indexer
        ("indexer") for this rank's windows, the halo's from the ranks before, and the windows' positions
        (the indexer's detached: no gradient comes back through its top-k)."""
        plan, gradient = self.plan, name == "compressor"
        if not len(plan.order):  # no window in the sequence: nothing to gather
            return kv[:, :0], gate[:, :0], 0
        if not gradient:
            kv, gate = kv.detach(), gate.detach()
        tails = plan.tails.to(kv.device)
        what = f"{self.path} {name} halo tokens and gates"
        mine = [kv.index_select(1, tails), gate.index_select(1, tails)]
        halo = gathered(mine, 1, self.call.mesh.get_group("cp"), self.path, what, gradient)
        self.halos[name] = halo
        take = plan.take.to(kv.device)
        chunk_kv = torch.cat([halo[0], kv], dim=1).index_select(1, take)
        chunk_gate = torch.cat([halo[1], gate], dim=1).index_select(1, take)
        return chunk_kv, chunk_gate, plan.first_positions.to(kv.device)

    def update_overlap_state(self, name: str, chunk_kv, chunk_gate, head_dim: int):
        """No window before the first pooled: where windows overlap, each run is led by the one before it."""
        return None, None

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """Every window's entry ``[B, windows, d]``, in window order: this rank's (the leading windows'
        dropped), every rank's padded to the most one keeps, gathered."""
        plan, gradient = self.plan, name == "compressor"
        if not len(plan.order):
            return compressed
        mine = compressed.index_select(1, plan.keep.to(compressed.device))
        mine = torch.nn.functional.pad(mine, (0, 0, 0, plan.slots - mine.shape[1]))
        if not gradient:
            mine = mine.detach()
        elif not len(plan.keep):
            # no window of its own: its padding depends, times 0, on all that the others' entries depend on,
            # so that it runs their reduce-scatters and its halo's (collectives) whenever they do
            anchors = [*self.halos[name], self.compressor.position_bias, self.compressor.kv_norm.weight]
            mine = mine + 0 * sum(anchor.sum() for anchor in anchors)
        group, entries = self.call.mesh.get_group("cp"), f"{self.path} {name} entries"
        whole = gathered([mine], 1, group, self.path, entries, gradient)[0]
        return whole.index_select(1, plan.order.to(whole.device))
