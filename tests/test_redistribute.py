"""Moves between specs: the plan is a pure choice of collective; running it on 2 and 4 gloo ranks equals
slicing the whole tensor computed on one process, forward and backward, with the optimal bytes on the wire."""

import warnings

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.comm.record import recording
from cpshard.comm.redistribute import Move, plan, redistribute, redistribute_together
from cpshard.debug.optimum import moved_bytes
from cpshard.spec.notation import Spec, SpecError
from cpshard.spec.sequence import positions


@pytest.mark.parametrize(
    "src, dst, moves",
    [
        ("b h s@cp d", "b h@cp s d", [Move("cp", "all_to_all", 2, 1)]),
        ("b s h@cp d", "b s@cp h d", [Move("cp", "all_to_all", 2, 1)]),
        ("b s d", "b s@cp d", [Move("cp", "slice", None, 1)]),
        ("b s@cp d", "b s@cp d", []),
        ("b s@(fsdp,cp) h", "b s@fsdp h@cp", [Move("cp", "all_to_all", 1, 2)]),
        ("b s@cp h@tp", "b s h@(tp,cp)", [Move("cp", "all_to_all", 1, 2)]),
        ("b s d", "b s@(fsdp,cp) d", [Move("fsdp", "slice", None, 1), Move("cp", "slice", None, 1)]),
        # the slice over y must come first, so that x ends up the minor axis of b
        ("a@x b", "a b@(y,x)", [Move("y", "slice", None, 1), Move("x", "all_to_all", 0, 1)]),
    ],
)
def test_plan(src, dst, moves):
    assert list(plan(src, dst)) == moves
    assert plan(Spec(src), Spec(dst)) == plan(src, dst)


def test_plan_under_compile_warns_of_no_skipped_cache():
    """Dynamo traces through a cached function with a warning to the user of "potential silent
    incorrectness"; under torch.compile plan asks no cache, and the graph holds the same moves."""
    torch._dynamo.utils.warn_once_cache.clear()  # Dynamo gives each warning once a process

    def moves(x):
        return x * len(plan("a@x b", "a b@(y,x)"))

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(moves, backend="eager", fullgraph=True)(torch.ones(2))
    assert torch.equal(compiled, moves(torch.ones(2)))
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]


@pytest.mark.parametrize(
    "src, dst, words",
    [
        ("b s@cp d", "b s d", ["un-splitting", "'s'", "'cp'"]),
        ("b h@cp s d", "b h s d@tp", ["un-splitting", "'h'", "'cp'"]),
        ("b s d", "b t d", ["dimensions differ"]),
        ("b s@(fsdp,cp) h", "b s@cp h@fsdp", ["'fsdp'", "minor-most", "'s'"]),
        ("n@(x,y)", "n@(y,x)", ["reorder"]),
        ("b s@cp d", "b s@cp:head_tail d", ["order of 's'", "cpshard.comm.reorder"]),
    ],
)
def test_plan_errors(src, dst, words):
    with pytest.raises(SpecError) as info:
        plan(src, dst)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_moved_bytes(dtype):
    shape = (2, 4, 8, 16)
    local = torch.zeros(shape, dtype=dtype)
    assert moved_bytes(shape, dtype, "b h s@cp d", "b h@cp s d") == local.numel() * local.element_size()
    assert moved_bytes(shape, dtype, "b h s d", "b h s@cp d") == 0
    assert moved_bytes(shape, dtype, "b h s@cp d", "b h s@cp d") == 0


# ---- on real gloo ranks ------------------------------------------------------------------------------------

SIZES = {"b": 2, "h": 4, "s": 8, "d": 3}
B, S, D = SIZES["b"], SIZES["s"], SIZES["d"]
MOVES = [("b h s@cp d", "b h@cp s d"), ("b s h@cp d", "b s@cp h d"), ("b s h d", "b s@cp h d")]


def _whole(*shape, seed=0):
    """The same random tensor on every rank: the single-process reference."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _block(full, dim, index, ways):
    return full if dim is None else full.chunk(ways, dim=dim)[index]


def _move_case(mesh, src, dst):
    """Forward, backward and bytes of one move against the whole tensor: (actual, expected) pairs."""
    cp, rank = mesh["cp"].size(), mesh.get_local_rank("cp")
    src_dim, dst_dim = Spec(src).sharded_dim("cp"), Spec(dst).sharded_dim("cp")
    shape = [SIZES[name] for name in Spec(src).names]
    full, weight = _whole(*shape), _whole(*shape, seed=1)
    x = _block(full, src_dim, rank, cp).clone().requires_grad_(True)
    with recording() as log:
        y = redistribute(x, src, dst, mesh, name="qkv")
        # a nonlinear loss of this rank's block; summed over the ranks it is the single-process loss
        (y.sin() * _block(weight, dst_dim, rank, cp)).sum().backward()
    whole = full.clone().requires_grad_(True)
    (whole.sin() * weight).sum().backward()
    if src_dim is None:  # a replicated input gets the gradient of this rank's block only
        grad = torch.zeros_like(full)
        _block(grad, dst_dim, rank, cp).copy_(_block(whole.grad, dst_dim, rank, cp))
    else:
        grad = _block(whole.grad, src_dim, rank, cp)
    optimum = moved_bytes(x.shape, x.dtype, src, dst)
    phase_bytes = log.bytes_by("phase")
    return {
        "output": (y.detach(), _block(full, dst_dim, rank, cp)),
        "grad": (x.grad, grad),
        "ops": (log.count_by("op"), {} if src_dim is None else {"all_to_all": 2}),
        "bytes": ((phase_bytes.get("forward", 0), phase_bytes.get("backward", 0)), (optimum, optimum)),
        "optimum": (optimum, 0 if src_dim is None else x.numel() * x.element_size()),
    }


def _redistribute_cases():
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    cases = {f"{src} -> {dst}": _move_case(mesh, src, dst) for src, dst in MOVES}
    full, rank = _whole(B, 4 * S, D), mesh.get_local_rank("cp")
    held = positions("head_tail", 4 * S, mesh["cp"].size(), rank)  # chunks r and 2P-1-r
    cases["head_tail"] = {"output": (redistribute(full, "b s d", "b s@cp:head_tail d", mesh), full[:, held])}
    errors = {}
    for label, x, src, dst in [
        ("uneven slice", _whole(B, S + 1, D), "b s d", "b s@cp d"),
        ("wrong ndim", _whole(B, S), "b h s@cp d", "b h@cp s d"),
        ("heads", _whole(B, 3, S, D), "b h s@cp d", "b h@cp s d"),
    ]:
        try:
            redistribute(x, src, dst, mesh, name="k")
        except (SpecError, ValueError) as error:
            errors[label] = str(error)
    return cases, errors


def _check_redistribute(results, cp):
    for cases, errors in results:
        for case, checks in cases.items():
            for what, (actual, expected) in checks.items():
                if isinstance(actual, torch.Tensor):
                    torch.testing.assert_close(actual, expected, msg=f"{case} {what}")
                else:
                    assert actual == expected, f"{case} {what}: {actual} != {expected}"
        for label, words in {
            "uneven slice": ["k", "dimension 1 (s)", f"{S + 1}", "'cp'", f"size {cp}"],
            "wrong ndim": ["k", "4 dimensions", f"({B}, {S})"],
            "heads": ["k", "dimension 1", f"{cp} ranks"],
        }.items():
            missing = [word for word in words if word not in errors.get(label, "")]
            assert not missing, f"{label}: {errors.get(label)!r} lacks {missing}"


@pytest.mark.ranks  # starts its own ranks
@pytest.mark.parametrize("world", [2, 4])
def test_redistribute_on_ranks(world, request):
    _check_redistribute(request.getfixturevalue(f"ranks{world}").run(_redistribute_cases), cp=world)


def _two_axis_case():
    """``b s@(fsdp,cp) h -> b s@fsdp h@cp`` on a 2 x 2 mesh: an all-to-all over cp only."""
    mesh = cpshard.make_mesh(cp=2, fsdp=2)
    fsdp, cp = mesh.get_local_rank("fsdp"), mesh.get_local_rank("cp")
    full = _whole(B, 8, 4)
    x = _block(full, 1, fsdp * 2 + cp, 4)
    with recording() as log:
        y = redistribute(x, "b s@(fsdp,cp) h", "b s@fsdp h@cp", mesh)
    return (
        y,
        _block(_block(full, 1, fsdp, 2), 2, cp, 2),
        [(e.op, e.group_size, e.nbytes) for e in log.events],
        x.nbytes,
    )


def test_redistribute_over_one_axis_of_two(ranks4):
    for y, expected, events, nbytes in ranks4.run(_two_axis_case):
        torch.testing.assert_close(y, expected)
        assert events == [("all_to_all", 2, nbytes)]


def _together_case():
    """q, k and v of other head counts and widths, k not trained, moved together: each as ``redistribute``
    moves it alone (the whole tensor's slice; the whole loss's gradient), in one all-to-all each way; of
    two dtypes, one all-to-all for each dtype."""
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    cp, rank = mesh["cp"].size(), mesh.get_local_rank("cp")
    wholes = [_whole(B, 4, S, 3), _whole(B, 8, S, 3, seed=1), _whole(B, 4, S, 5, seed=2)]
    weights = [_whole(*w.shape, seed=3 + i) for i, w in enumerate(wholes)]
    xs = [_block(w, 2, rank, cp).clone().requires_grad_(i != 1) for i, w in enumerate(wholes)]
    with recording() as log:
        ys = redistribute_together(tuple(xs), "b h s@cp d", "b h@cp s d", mesh, name="qkv")
        sum((y.sin() * _block(w, 1, rank, cp)).sum() for y, w in zip(ys, weights)).backward()
    outputs = [(y.detach(), _block(w, 1, rank, cp)) for y, w in zip(ys, wholes)]
    grads = [
        (x.grad, None if i == 1 else _block(w.cos() * weight, 2, rank, cp))
        for i, (x, w, weight) in enumerate(zip(xs, wholes, weights))
    ]
    events = [(e.op, e.phase, e.nbytes) for e in log.events]
    sizes = [x.numel() * x.element_size() for x in xs]
    expected = [("all_to_all", "forward", sum(sizes)), ("all_to_all", "backward", sizes[0] + sizes[2])]
    with recording() as mixed:  # k in fp32 between q and v in fp64: one all-to-all for q and v, one for k
        moved = redistribute_together((xs[0], xs[1].float(), xs[2]), "b h s@cp d", "b h@cp s d", mesh)
    outputs += [(y.detach(), _block(w, 1, rank, cp).to(y.dtype)) for y, w in zip(moved, wholes)]
    return (
        outputs,
        grads,
        (events, expected),
        ([e.nbytes for e in mixed.events], [sizes[0] + sizes[2], sizes[1] // 2]),
    )


def test_redistribute_together_is_each_move_in_one_all_to_all(ranks2, ranks4):
    for results in (ranks2.run(_together_case), ranks4.run(_together_case)):
        for outputs, grads, *counts in results:
            for actual, expected in outputs:
                torch.testing.assert_close(actual, expected)
            for actual, expected in grads:
                assert (actual is None) == (expected is None)
                if expected is not None:
                    torch.testing.assert_close(actual, expected)
            for actual, expected in counts:
                assert actual == expected
