"""Specs: parsing, printing, immutability, errors, and placements on a real 4-rank mesh."""

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import cpshard
from cpshard.spec.notation import Dim, Spec, SpecError


@pytest.mark.parametrize(
    "text, dims",
    [
        ("b s@cp d", (Dim("b"), Dim("s", ("cp",)), Dim("d"))),
        ("n@(fsdp,cp)", (Dim("n", ("fsdp", "cp")),)),
        ("  n@( fsdp , cp )   d ", (Dim("n", ("fsdp", "cp")), Dim("d"))),
        ("b h@cp s d@tp", (Dim("b"), Dim("h", ("cp",)), Dim("s"), Dim("d", ("tp",)))),
        ("x@(cp)", (Dim("x", ("cp",)),)),
        ("b s@cp:head_tail d", (Dim("b"), Dim("s", ("cp",), "head_tail"), Dim("d"))),
        ("", ()),
    ],
)
def test_parse(text, dims):
    assert Spec(text).dims == dims


@pytest.mark.parametrize(
    "text",
    ["b s@cp d", "n@(fsdp,cp)", "b h@cp s d@tp", "n@(dp_replicate,fsdp,cp) v", "b s@cp:head_tail d", ""],
)
def test_str_round_trip(text):
    spec = Spec(text)
    assert str(spec) == text
    assert Spec(str(spec)) == spec
    assert Spec(spec) == spec
    assert eval(repr(spec), {"Spec": Spec}) == spec


def test_value_semantics():
    spec = Spec("b s@cp d")
    assert spec == Spec("b  s@cp   d") and hash(spec) == hash(Spec("b  s@cp   d"))
    assert spec != Spec("b s d@cp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dims = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dims[1].axes = ()
    assert spec.unsharded("cp") == Spec("b s d") and spec == Spec(
        "b s@cp d"
    )  # new values, the old one unchanged
    assert spec.sharded("d", "tp") == Spec("b s@cp d@tp")
    assert Spec("n@fsdp").sharded("n", "cp") == Spec("n@(fsdp,cp)")


def test_queries():
    spec = Spec("b h@cp s d@(fsdp,tp)")
    assert spec.names == ("b", "h", "s", "d")
    assert spec.axes == ("cp", "fsdp", "tp")
    assert [spec.dim_of(n) for n in spec.names] == [0, 1, 2, 3]
    assert [spec.sharded_dim(a) for a in ("cp", "fsdp", "tp", "dp_replicate")] == [1, 3, 3, None]
    with pytest.raises(SpecError, match="no dimension 'v'"):
        spec.dim_of("v")


@pytest.mark.parametrize(
    "text, words",
    [
        ("b s@cp s", ["'s'", "twice"]),
        ("b@cp s@cp", ["'cp'", "'b'", "'s'"]),
        ("n@(cp,cp)", ["'cp'", "'n'"]),
        ("b s@ d", ["'s@'"]),
        ("b 1s", ["'1s'"]),
        ("n@(fsdp cp)", ["n@(fsdp cp)"]),
        ("n@()", ["n@()"]),
        ("n@(a,,b)", ["n@(a,,b)"]),
        ("n@(a", ["n@(a"]),
        ("s@cp:zigzag", ["'zigzag'", "contiguous, head_tail"]),
        ("s@(fsdp,cp):head_tail", ["one axis"]),
        ("s:head_tail", ["'s:head_tail'"]),
    ],
)
def test_parse_errors(text, words):
    with pytest.raises(SpecError) as info:
        Spec(text)
    for word in words:
        assert word in str(info.value)
    assert isinstance(info.value, ValueError)


def test_sharded_on_a_used_axis_raises():
    with pytest.raises(SpecError, match="'cp'"):
        Spec("b s@cp d").sharded("d", "cp")


# ---- on a real mesh: dp_replicate=1, fsdp=2, cp=2, tp=1 over 4 gloo ranks ----------------------------------


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
        spec.check(whole.shape, mesh, tensor="x")
        placements = spec.placements(mesh)
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
            Spec(text).check(shape, mesh, tensor="hidden")
        except SpecError as error:
            errors[text] = str(error)
    try:
        Spec("n@(cp,fsdp) d").placements(mesh, tensor="weight")
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


def test_an_order_is_declared_per_axis():
    spec = Spec("b s@cp d").ordered("cp", "head_tail")
    assert spec == Spec("b s@cp:head_tail d") and spec.ordered("cp", "contiguous") == Spec("b s@cp d")
    assert Spec("b s d").ordered("cp", "head_tail") == Spec("b s d")  # nothing split over cp: unchanged
