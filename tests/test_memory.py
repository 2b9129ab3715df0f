"""The live-tensor peak: exact sizes, views and in-place ops allocate nothing, and an output autograd saves
stays counted after its last Python tensor is gone."""

import torch

from cpshard.tools.memory import LiveTensors

MIB = 2**20


def test_peak_counts_what_lives_at_once():
    with LiveTensors() as live:
        a = torch.ones(MIB // 4)  # 1 MiB
        b = torch.ones(2 * MIB // 4)  # 2 MiB: 3 alive
        del a, b
        c = torch.ones(MIB // 4)  # 1 MiB alone
        c.add_(1).view(2, -1).t()  # in place and views: nothing new
    assert live.peak == 3 * MIB
    assert live.total == MIB  # c is still alive
    assert [what for _, what in live.at_peak] == ["ones [524288] float32", "ones [262144] float32"]


def test_storages_made_before_the_block_are_not_counted():
    outside, parameter = torch.ones(MIB // 4), torch.nn.Parameter(torch.ones(MIB // 4))
    with LiveTensors() as live:
        outside[:10].mul_(2)
        outside.detach()
        parameter.detach()
    assert live.peak == 0


def test_a_saved_output_counts_until_the_backward_frees_it():
    leaf = torch.ones(MIB // 4, requires_grad=True)
    with LiveTensors() as live:
        loss = leaf.exp().sum()  # exp's output is saved for its backward; no Python tensor holds it
        held = live.total
        loss.backward()
        del loss
        after = live.total
        leaf.grad = None
    assert held >= MIB
    assert after == MIB  # the leaf's gradient alone: exp's output went with the graph
    assert live.total == 0
