"""Meshes: make_mesh's checks and layout, cp_size, and the groups the forward reduces over."""

import itertools

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cpshard
from cpshard.parallel.mesh import MESH_AXES, TOKEN_AXES, cp_size, group_over, split_cp


@pytest.mark.parametrize(
    "sizes, words",
    [
        (dict(cp=0), ["cp=0", "positive"]),
        (dict(cp=2, fsdp=-1), ["fsdp=-1"]),
        (dict(cp=2, tp=1.5), ["tp=1.5"]),
        (dict(cp=2, dp_replicate="2"), ["dp_replicate='2'"]),
        (dict(cp=2, ep=0), ["ep=0"]),
        (dict(cp=2, fsdp=3, ep=4), ["ep=4", "3 * 2 * 1 = 6"]),
        (dict(cp=3, tp=2, ep=3), ["ep=3 with tp=2", "must hold whole tp groups", "or lie inside one"]),
    ],
)
def test_make_mesh_rejects_sizes_before_any_process_group(sizes, words):
    with pytest.raises(ValueError) as info:
        cpshard.make_mesh(**sizes)
    assert all(word in str(info.value) for word in words), str(info.value)
    assert not dist.is_initialized()


def test_make_mesh_without_a_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(RuntimeError) as info:
        cpshard.make_mesh(cp=1, device_type="cpu")
    assert "RANK, WORLD_SIZE, MASTER_ADDR are not set" in str(info.value) and "cpshard.launch" in str(
        info.value
    )
    assert not dist.is_initialized()


def _members(sizes: dict, rank: int, dims) -> list[int]:
    """The ranks that differ from ``rank`` only along ``dims``, in a row-major mesh of ``sizes`` (the
    reference)."""
    grid = list(itertools.product(*(range(n) for n in sizes.values())))
    mine = grid[rank]
    keep = [i for i, name in enumerate(sizes) if name not in dims]
    return [r for r, coord in enumerate(grid) if all(coord[i] == mine[i] for i in keep)]


def _group_ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


#: meshes and the dims to group over, for 2 and 4 ranks
MESHES = {
    2: [dict(cp=2)],
    4: [
        dict(cp=2, fsdp=2),
        dict(cp=4),
        dict(cp=2, tp=2),
        dict(cp=2, dp_replicate=2),
        dict(cp=1, fsdp=2, tp=2),
    ],
}
DIMS = [
    ("cp",),
    ("fsdp",),
    ("tp",),
    ("fsdp", "cp"),
    ("cp", "fsdp"),
    TOKEN_AXES,
    ("dp_replicate", "tp"),
    (),
    ("ep",),
]


def _split_cases(world: int, rank: int) -> list:
    """``split_cp``: Ulysses groups of consecutive cp ranks, rings across them."""
    cases = []
    splits = [
        (dict(cp=world), world // 2, 2),
        (dict(cp=world), world, 1),
        (dict(cp=2, fsdp=world // 2), 1, 2),
    ]
    for sizes, ring, ulysses in splits:
        mesh = cpshard.make_mesh(**sizes)
        split = split_cp(mesh, ring, ulysses)
        label = f"{sizes} split {ring}x{ulysses}"
        cases.append((f"{label} cached", split_cp(mesh, ring, ulysses) is split, True))
        cases.append((f"{label} names", split.mesh_dim_names, ("cp_ring", "cp_ulysses")))
        cp = sizes["cp"]
        row = rank - rank % cp  # the first rank of this cp group (cp is the minor dimension here)
        r, u = divmod(rank % cp, ulysses)
        groups = {
            "cp_ulysses": [row + r * ulysses + k for k in range(ulysses)],
            "cp_ring": [row + k * ulysses + u for k in range(ring)],
        }
        for dim, expected in groups.items():
            cases.append((f"{label} {dim}", dist.get_process_group_ranks(split.get_group(dim)), expected))
    return cases


def _mesh_cases():
    world, rank = dist.get_world_size(), dist.get_rank()
    cases = []
    for sizes in MESHES[world]:
        mesh = cpshard.make_mesh(**sizes)
        full = {name: sizes.get(name, 1) for name in MESH_AXES}
        cases.append((f"{sizes} names", mesh.mesh_dim_names, MESH_AXES))
        cases.append((f"{sizes} shape", tuple(mesh.shape), tuple(full.values())))
        grid = list(itertools.product(*map(range, full.values())))  # row-major
        cases.append((f"{sizes} coordinate", tuple(mesh.get_coordinate()), grid[rank]))
        cases.append((f"{sizes} cp_size", cp_size(mesh), full["cp"]))
        for dims in DIMS:
            wide = [d for d in dims if full.get(d, 1) > 1]
            expected = _members(full, rank, dims) if wide else None
            for attempt in range(2):  # a second call finds the same group
                cases.append(
                    (f"{sizes} group_over{dims} #{attempt}", _group_ranks(group_over(mesh, dims)), expected)
                )
    cases += _split_cases(world, rank)
    errors = []
    for wrong in [dict(cp=2, fsdp=3), dict(cp=1), dict(cp=world, tp=2)]:
        try:
            cpshard.make_mesh(**wrong)
        except ValueError as error:
            errors.append(str(error))
    for mesh in [
        init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
        init_device_mesh("cpu", (world,)),
    ]:
        try:
            cp_size(mesh)
        except ValueError as error:
            errors.append(str(error))
    return cases, errors


@pytest.mark.ranks  # starts its own ranks
@pytest.mark.parametrize("world", [2, 4])
def test_meshes_on_ranks(world, request):
    for rank, (cases, errors) in enumerate(request.getfixturevalue(f"ranks{world}").run(_mesh_cases)):
        for label, actual, expected in cases:
            assert actual == expected, f"rank {rank}, {label}: {actual} != {expected}"
        assert len(errors) == 5, errors
        assert errors[0].startswith(f"world size {world} != dp_replicate=1 * fsdp=3 * cp=2 * tp=1"), errors[0]
        assert errors[1].startswith(f"world size {world} != dp_replicate=1 * fsdp=1 * cp=1 * tp=1"), errors[1]
        assert errors[2].startswith(f"world size {world} != dp_replicate=1 * fsdp=1 * cp={world} * tp=2"), (
            errors[2]
        )
        assert "no 'cp' dimension" in errors[3] and "dp" in errors[3] and "make_mesh(cp=N)" in errors[3]
        assert "no 'cp' dimension" in errors[4] and "unnamed" in errors[4]


def forward_with_a_rank_absent() -> str:
    """Rank 1 never comes to the forward; rank 0's first collective gives up after the mesh's timeout."""
    mesh = cpshard.make_mesh(cp=2, timeout=3)
    if dist.get_rank() == 1:
        return "absent"
    model = cpshard.tiny_model("llama")
    try:
        cpshard.make_cp_forward(model)(cpshard.params_of(model), cpshard.tiny_batch(128, 2, 8), mesh)
    except cpshard.CollectiveError as error:
        return str(error)
    return "no error"


@pytest.mark.ranks
def test_a_rank_that_never_arrives_is_named_on_the_waiting_ranks():
    """Its own two ranks: a group a collective timed out on is of no use to later tests."""
    with cpshard.LocalRanks(2) as ranks:
        waiting, absent = ranks.run(forward_with_a_rank_absent)
        ranks.close(force=True)  # their groups would wait out their timeouts on the way down
    assert absent == "absent"
    for words in ("did not complete: a rank of its group did not arrive", "over the mesh axis 'cp'"):
        assert words in waiting, waiting
    assert "make_mesh(timeout=...)" in waiting and "Timed out" in waiting, waiting


def test_make_mesh_refuses_a_timeout_that_is_not_positive():
    with pytest.raises(ValueError, match="timeout=-1 must be positive seconds"):
        cpshard.make_mesh(cp=1, timeout=-1)
