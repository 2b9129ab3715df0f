"""visualize: the picture of who holds what, checked against where DTensor really puts the data."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from cpshard.debug import visualize
from cpshard.debug.visualize import blocks, picture


def _holds_its_block(x: DTensor) -> bool:
    """This rank's local data is exactly the block ``blocks`` says it holds."""
    block = blocks(x)[dist.get_rank()]
    full = x.full_tensor()
    return torch.equal(x.to_local(), full[tuple(slice(a, b) for a, b in block)])


def two_ranks():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    data = torch.arange(4 * 8 * 3, dtype=torch.float32)
    cases = {
        "columns": distribute_tensor(data[:32].view(4, 8), mesh, [Shard(1)]),
        "uneven rows": distribute_tensor(data[:15].view(5, 3), mesh, [Shard(0)]),
        "3-D": distribute_tensor(data[:36].view(2, 6, 3), mesh, [Shard(1)]),
        "replicated": distribute_tensor(data[:5], mesh, [Replicate()]),
    }
    return {name: (picture(x), _holds_its_block(x)) for name, x in cases.items()}


def test_two_ranks(ranks2):
    for pictures in ranks2.run(two_ranks):
        assert all(ok for _, ok in pictures.values()), "a rank's local data is not the block drawn for it"
        # rank 0 holds columns 0:4, rank 1 columns 4:8; every row; each box is its label plus 4 wide
        assert pictures["columns"][0] == "\n".join(
            [
                "f32[4, 8@cp]",
                "rows x columns: dim 0 x dim 1; each box names the ranks holding it",
                "       0:4     4:8",
                "    ┌───────┬───────┐",
                "0:4 │   0   │   1   │",
                "    └───────┴───────┘",
            ]
        )
        # DTensor chunks 5 rows as ceil(5/2) = 3, then 2
        uneven = pictures["uneven rows"][0].splitlines()
        assert [line.split("│")[0].strip() for line in uneven if "│" in line] == ["0:3", "3:5"]
        assert [line.split("│")[1].strip() for line in uneven if "│" in line] == ["0", "1"]
        three = pictures["3-D"][0].splitlines()
        assert (
            three[1].startswith("rows x columns: dim 0 x dim 1")
            and three[2] == "dim 2 is whole (3) in every block"
        )
        assert "│   0   │   1   │" in pictures["3-D"][0]
        assert "│  0,1  │" in pictures["replicated"][0] and pictures["replicated"][0].startswith(
            "f32[5]\ncolumns: dim 0"
        )


def four_ranks():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "cp"))
    data = torch.arange(64, dtype=torch.float32)
    cases = {
        "grid": distribute_tensor(data[:15].view(3, 5), mesh, [Shard(0), Shard(1)]),
        "nested": distribute_tensor(data[:3], mesh, [Shard(0), Shard(0)]),
        "partial": DTensor.from_local(torch.ones(2, 4), mesh, [Partial(), Shard(1)]),
        "3-D": distribute_tensor(data[:32].view(2, 4, 4), mesh, [Shard(1), Shard(2)]),
    }
    held = {name: _holds_its_block(x) for name, x in cases.items() if name != "partial"}
    return {name: picture(x) for name, x in cases.items()}, held


def _cells(text: str) -> list[list[str]]:
    """The box labels, row by row."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if "│" in line]


def test_four_ranks(ranks4):
    for pictures, held in ranks4.run(four_ranks):
        assert all(held.values()), held
        # rank = fsdp * 2 + cp; fsdp splits rows 0:2 | 2:3, cp splits columns 0:3 | 3:5
        assert _cells(pictures["grid"]) == [["0", "1"], ["2", "3"]]
        assert "0:2 │" in pictures["grid"] and "2:3 │" in pictures["grid"]
        # 3 elements: fsdp halves 0:2 | 2:3, cp halves those: 0:1, 1:2, 2:3 and nothing for rank 3
        assert _cells(pictures["nested"]) == [["0", "1", "2"]]
        assert pictures["nested"].endswith("ranks holding no elements: 3")
        # a pending sum: every fsdp rank holds (a part of) each cp block
        assert pictures["partial"].startswith("f32[2, 8@cp] Partial(sum)@fsdp")
        assert _cells(pictures["partial"]) == [["0,2", "1,3"]]
        assert "dim 0 is whole (2) in every block" in pictures["3-D"]
        assert _cells(pictures["3-D"]) == [["0", "1"], ["2", "3"]]


def test_plain_tensor_and_bad_ranks(capsys):
    text = visualize(torch.zeros(3, 2))
    assert capsys.readouterr().out == text + "\n"
    assert _cells(text) == [["0"]]
    assert visualize(torch.zeros(3), show=False) and capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="1-D to 3-D"):
        visualize(torch.zeros(1, 2, 3, 4))
