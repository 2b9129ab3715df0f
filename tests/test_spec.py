"""Specs as values: parsing, printing, immutability, the transforms (orders kept) and errors."""

import dataclasses

import pytest

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


def test_an_order_is_declared_per_axis():
    spec = Spec("b s@cp d").ordered("cp", "head_tail")
    assert spec == Spec("b s@cp:head_tail d") and spec.ordered("cp", "contiguous") == Spec("b s@cp d")
    assert Spec("b s d").ordered("cp", "head_tail") == Spec("b s d")  # nothing split over cp: unchanged


def test_transforms_keep_a_dimension_s_order():
    spec = Spec("b s@cp:head_tail d")
    assert spec.renamed("cp", "cp_ulysses") == Spec("b s@cp_ulysses:head_tail d")
    assert spec.unsharded("cp") == Spec("b s d")  # whole: gathered in its own order
    assert spec.unsharded("tp") == spec and spec.sharded("d", "tp") == Spec("b s@cp:head_tail d@tp")
    assert Spec("b s@(cp,tp) d").unsharded("tp") == Spec("b s@cp d")
    with pytest.raises(SpecError, match="head_tail order, which a split over cp, tp cannot keep"):
        spec.sharded("s", "tp")
