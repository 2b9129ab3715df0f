"""Where a process group carries cpshard's check rows: a CPU row stays on the CPU wherever the group's backend
serves CPUs, and crosses an NCCL-only group on the accelerator (which this machine cannot run: the rule is
checked on the backends' own strings)."""

import pytest
import torch
import torch.distributed as dist

from cpshard.comm.carrier import carried, carrying_device_type, served_device_types


@pytest.mark.parametrize(
    "backend, served",
    [
        ("gloo", ("cpu", "cuda")),
        ("nccl", ("cuda",)),
        ("NCCL", ("cuda",)),
        ("cpu:gloo,cuda:nccl", ("cpu", "cuda")),
        ("cuda:nccl", ("cuda",)),
        ("xccl", ("xpu",)),
        ("someone_elses", ()),
    ],
)
def test_the_device_types_a_backend_serves(backend, served):
    assert served_device_types(backend) == served


@pytest.mark.parametrize(
    "served, device_type, carrier",
    [
        (("cpu", "cuda"), "cpu", "cpu"),  # gloo, or a cpu:gloo,cuda:nccl group: the row stays
        (("cpu", "cuda"), "cuda", "cuda"),  # a token row already on the GPU stays there
        (("cuda",), "cpu", "cuda"),  # NCCL alone: the CPU row crosses on the accelerator
        (("cuda",), "cuda", "cuda"),
        (("xpu",), "cpu", "xpu"),
        ((), "cpu", "cpu"),  # a backend torch does not know: left as it is
    ],
)
def test_a_row_travels_on_a_device_the_group_serves(served, device_type, carrier):
    assert carrying_device_type(served, device_type) == carrier


def test_on_a_gloo_group_a_cpu_row_is_not_copied(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        row = torch.arange(3)
        assert carried(row, dist.group.WORLD) is row
    finally:
        dist.destroy_process_group()
