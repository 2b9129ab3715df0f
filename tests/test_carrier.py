"""Where a process group carries cpshard's check rows: a CPU row stays on the CPU wherever the group's backend
serves CPUs, and crosses an NCCL-only group on the accelerator (which this machine cannot run: the rule is
checked on the backends' own strings)."""

import pytest
import torch
import torch.distributed as dist

from cpshard.comm.carrier import backend_device_types, carried, carrying_device_type, served_device_types


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
        ("undefined", ()),  # init_process_group() without a name: the group itself says what it carries
    ],
)
def test_the_device_types_a_backend_serves(backend, served):
    assert backend_device_types(backend) == served


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


@pytest.mark.parametrize("backend", ["gloo", None])
def test_a_group_says_what_it_carries_and_a_cpu_row_stays(tmp_path, backend):
    # without a name torch makes the accelerator's backend alone (the CPU's here): its string is "undefined"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert "cpu" in served_device_types(dist.group.WORLD)
        row = torch.arange(3)
        assert carried(row, dist.group.WORLD) is row
    finally:
        dist.destroy_process_group()
