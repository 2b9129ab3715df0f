"""typeof: JAX-style type strings of tensors, DTensors (sharded, multi-axis, Partial) and pytrees."""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import cpshard
from cpshard.debug import typeof
from cpshard.tools.tiny import tiny_batch, tiny_model


@pytest.mark.parametrize(
    "dtype, name",
    [
        (torch.float32, "f32"),
        (torch.bfloat16, "bf16"),
        (torch.float16, "f16"),
        (torch.float64, "f64"),
        (torch.int32, "i32"),
        (torch.int64, "i64"),
        (torch.bool, "bool"),
        (torch.uint8, "u8"),
        (torch.int8, "i8"),
        (torch.complex64, "c64"),
        (torch.float8_e4m3fn, "f8_e4m3fn"),
    ],
)
def test_dtype_names_as_jax_writes_them(dtype, name):
    assert typeof(torch.zeros(2, 3, dtype=dtype)) == f"{name}[2, 3]"


def test_plain_tensors_have_no_placement():
    assert typeof(torch.zeros(2, 4096, 64)) == "f32[2, 4096, 64]"
    assert typeof(torch.tensor(1.0)) == "f32[]"
    assert typeof(torch.zeros(0, 3, dtype=torch.int64)) == "i64[0, 3]"


@dataclass
class Pair:
    first: torch.Tensor
    second: object


def test_pytree_is_a_table_of_paths_and_types():
    tree = {
        "params": {"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "steps": [torch.tensor(2), None],
    }
    lines = typeof(tree).splitlines()
    # optree orders dict keys; every row: path, padding to one column, type
    assert [line.split(None, 1) for line in lines] == [
        ["params.b", "bf16[4]"],
        ["params.w", "f32[3, 4]"],
        ["steps[0]", "i64[]"],
        ["steps[1]", "None"],
    ]
    assert len({line.index(line.split(None, 1)[1]) for line in lines}) == 1, (
        "types are not aligned in one column"
    )
    assert [line.split(None, 1) for line in typeof(Pair(torch.zeros(1), 3)).splitlines()] == [
        ["first", "f32[1]"],
        ["second", "int"],
    ]


def placements_2x2():
    """Strings on a 2x2 (fsdp, cp) mesh; the strided case is checked against where the rows really are."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "cp"))
    full = torch.zeros(4, 8)
    rank = dist.get_rank()
    # cp splits first (major), fsdp within: the block index of rank (f, c) is c * 2 + f
    strided = DTensor.from_local(
        torch.full((2, 4), float(rank)),
        mesh,
        [_StridedShard(0, split_factor=2), Shard(0)],
        shape=torch.Size((8, 4)),
        stride=(4, 1),
    )
    holders = strided.full_tensor()[::2, 0].tolist()  # the rank holding each of the 4 row blocks
    return {
        "both on dim 1": typeof(distribute_tensor(full, mesh, [Shard(1), Shard(1)])),
        "one each": typeof(distribute_tensor(full, mesh, [Shard(1), Shard(0)])),
        "partial + shard": typeof(DTensor.from_local(torch.zeros(4, 4), mesh, [Partial(), Shard(1)])),
        "partial both": typeof(
            DTensor.from_local(torch.zeros(4, 8, dtype=torch.bfloat16), mesh, [Partial(), Partial()])
        ),
        "partial max": typeof(DTensor.from_local(torch.zeros(2, 8), mesh, [Shard(0), Partial("max")])),
        "replicated": typeof(distribute_tensor(full, mesh, [Replicate(), Replicate()])),
        "strided": typeof(strided),
        "strided holders": holders,
    }


def test_dtensor_placements_on_a_2x2_mesh(ranks4):
    expected = {
        "both on dim 1": "f32[4, 8@(fsdp,cp)]",
        "one each": "f32[4@cp, 8@fsdp]",
        "partial + shard": "f32[4, 8@cp] Partial(sum)@fsdp",
        "partial both": "bf16[4, 8] Partial(sum)@(fsdp,cp)",
        "partial max": "f32[4@fsdp, 8] Partial(max)@cp",
        "replicated": "f32[4, 8]",
        "strided": "f32[8@(cp,fsdp), 4]",
        # blocks 0..3 in cp-major order: (f, c) = (0,0), (1,0), (0,1), (1,1) -> ranks 0, 2, 1, 3
        "strided holders": [0.0, 2.0, 1.0, 3.0],
    }
    for result in ranks4.run(placements_2x2):
        assert result == expected


def cp_output_types():
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 13)
    cp_forward = cpshard.make_cp_forward(model, token_logprobs=True, token_statistics=("entropy", "top1"))
    output = cp_forward(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))
    return typeof(output.logits), typeof(output)


def test_cp_output(ranks2):
    vocab = 128  # cpshard.tools.tiny_sizes.SMALL
    for logits, table in ranks2.run(cp_output_types):
        assert logits == f"f32[2, 13@cp, {vocab}]"
        assert [line.split(None, 1) for line in table.splitlines()] == [
            ["loss", "f32[]"],
            ["logits", f"f32[2, 13@cp, {vocab}]"],
            ["num_tokens", "i64[]"],
            ["token_logprobs", "f32[2, 13@cp]"],
            ["token_statistics.entropy", "f32[2, 13@cp]"],
            ["token_statistics.top1", "bool[2, 13@cp]"],
        ]
