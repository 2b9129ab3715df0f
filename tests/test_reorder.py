"""Head-tail back to DTensor chunks on real ranks: values, gradients and bytes."""

import torch
import torch.distributed as dist

from cpshard.comm.record import recording
from cpshard.comm.reorder import to_chunks
from cpshard.spec.sequence import chunk_positions, positions


def run_to_chunks(length: int, padded: int):
    size, rank = dist.get_world_size(), dist.get_rank()
    whole = torch.randn(2, padded, 3, generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, length, 3, generator=torch.Generator().manual_seed(1))
    mine = whole[:, positions("head_tail", padded, size, rank)].clone().requires_grad_()
    with recording() as log:
        chunk = to_chunks(mine, 1, "head_tail", padded, length, dist.group.WORLD)
        target = chunk_positions(length, size, rank)
        (chunk * weights[:, target]).sum().backward()
    # one process: the gradient of sum(whole[:, :length] * weights) at my positions
    expected_grad = torch.zeros(2, padded, 3)
    expected_grad[:, :length] = weights
    return (
        torch.equal(chunk, whole[:, target]),
        torch.equal(mine.grad, expected_grad[:, positions("head_tail", padded, size, rank)]),
        [e.phase for e in log.events],
    )


def test_head_tail_to_chunks_drops_padding_and_routes_gradients_back(ranks4):
    for values_ok, grads_ok, phases in ranks4.run(run_to_chunks, 13, 16):
        assert values_ok and grads_ok and phases == ["forward", "backward"]
