"""Specs on a mesh: shapes that fit or a named error, and DTensor placements that hold each rank's block
(a real 4-rank mesh: dp_replicate=1, fsdp=2, cp=2, tp=1, on gloo)."""

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import cpshard
from cpshard.comm.placements import check_fits, dtensor_placements
from cpshard.spec.notation import Spec, SpecError


def _expected_local(full: torch.Tensor, spec: Spec, coordinate: dict, sizes: dict) -> torch.Tensor:
    """The block of ``full`` a rank at ``coordinate`` holds under ``spec``: per dim, axes major first."""
    for index, dim in enumerate(spec.dims):
        chunk, ways = 0, 1
        for axis in dim.axes:
            chunk, ways = chunk * sizes[axis] + coordinate[axis], ways * sizes[axis]
        width = full.shape[index] // ways
        full = full.narrow(index, chunk * width, width)
    return full


PLACED = [
    "b s@cp d",
    "b s@fsdp d@cp",
    "n@(fsdp,cp) d",
    "b s d",
    "b@fsdp s d@(cp,tp)",
    "n@(dp_replicate,fsdp,cp) d",
]


def _placements_on_mesh():
    mesh = cpshard.make_mesh(cp=2, fsdp=2)
    names = mesh.mesh_dim_names
    coordinate = dict(zip(names, mesh.get_coordinate()))
    sizes = {name: mesh.size(i) for i, name in enumerate(names)}
    full = torch.arange(4 * 8 * 6, dtype=torch.float32).reshape(4, 8, 6)
    results = {}
    for text in PLACED:
        spec = Spec(text)
        shape = full.shape if len(spec.dims) == 3 else (32, 6)
        whole = full.reshape(shape)
        check_fits(spec, whole.shape, mesh, tensor="x")
        placements = dtensor_placements(spec, mesh)
        local = distribute_tensor(whole, mesh, placements).to_local()
        results[text] = (placements, local, _expected_local(whole, spec, coordinate, sizes))
    errors = {}
    for text, shape in [
        ("b s@cp d", (4, 7, 6)),  # 7 tokens over cp=2
        ("n@(fsdp,cp) d", (6, 6)),  # 6 rows over 2 x 2
        ("b s@sp d", (4, 8, 6)),  # no such axis
        ("b s@cp", (4, 8, 6)),  # 2 names for 3 dims
        ("n@(cp,fsdp) d", (8, 6)),  # against the mesh order
    ]:
        try:
            check_fits(Spec(text), shape, mesh, tensor="hidden")
        except SpecError as error:
            errors[text] = str(error)
    try:
        dtensor_placements(Spec("n@(cp,fsdp) d"), mesh, tensor="weight")
    except SpecError as error:
        errors["placements"] = str(error)
    return results, errors


def test_placements_on_a_real_mesh(ranks4):
    for results, errors in ranks4.run(_placements_on_mesh):
        for text, (_placements, local, expected) in results.items():
            torch.testing.assert_close(local, expected, rtol=0, atol=0, msg=text)
        assert results["b s@cp d"][0] == (Replicate(), Replicate(), Shard(1), Replicate())
        assert results["n@(fsdp,cp) d"][0] == (Replicate(), Shard(0), Shard(0), Replicate())
        assert results["b s d"][0] == (Replicate(),) * 4
        for text, words in {
            "b s@cp d": ["hidden", "dimension 1 (s)", "size 7", "cp", "size 2"],
            "n@(fsdp,cp) d": ["hidden", "dimension 0 (n)", "size 6", "fsdpxcp", "size 4"],
            "b s@sp d": ["hidden", "dimension 1 (s)", "'sp'", "dp_replicate, fsdp, cp, tp"],
            "b s@cp": ["hidden", "2 dimensions", "(4, 8, 6)"],
            "n@(cp,fsdp) d": ["hidden", "dimension 0 (n)", "n@(cp,fsdp)", "fsdp, cp"],
            "placements": ["weight", "dimension 0 (n)", "n@(cp,fsdp)"],
        }.items():
            assert text in errors, f"{text}: no error raised"
            for word in words:
                assert word in errors[text], (word, errors[text])
