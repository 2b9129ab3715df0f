"""Differentiable collectives on real gloo groups (the whole world, and the cp rows of a 2 x 2 mesh), against
references computed on one process from every rank's data; each reports its bytes to the open recording."""

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.comm.collectives import (
    all_gather_rows,
    all_gather_shards,
    gather_shares,
    scatter_sums,
    share_rows,
    sum_many_grads_over_group,
    sum_over_group,
)
from cpshard.comm.exchange import all_to_all
from cpshard.comm.record import recording

#: (scatter_dim, gather_dim) pairs, negative dims included
EXCHANGES = [(1, 2), (2, 1), (0, 1), (-1, 0)]


def _data(seed: int, *shape, dtype=torch.float64) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (values * 100).to(dtype) if not dtype.is_floating_point else values.to(dtype)


def _groups():
    """The group of every rank, and on 4 ranks the cp rows of a fsdp=2 x cp=2 mesh."""
    world = dist.get_world_size()
    groups = {"world": cpshard.make_mesh(cp=world).get_group("cp")}
    if world == 4:
        groups["cp of 2x2"] = cpshard.make_mesh(cp=2, fsdp=2).get_group("cp")
    return groups


def _all_to_all_case(group, scatter_dim, gather_dim, donate: bool = False):
    """One exchange against the whole tensor on one process; ``donate``: of a copy of x (the caller
    reads it no more), whose storage takes the result where what arrives must be copied into place, and
    the result is still a tensor of its own (modified in place)."""
    size, index = dist.get_world_size(group), dist.get_rank(group)
    seed = dist.get_process_group_ranks(group)[0]  # the same whole tensor within the group
    full, weight = _data(seed, 4, 8, 12), _data(seed + 100, 4, 8, 12)
    x = full.chunk(size, gather_dim)[index].clone().requires_grad_(True)
    sent = x.clone() if donate else x
    with recording() as log:
        y = all_to_all(sent, scatter_dim, gather_dim, group, name="probe", donate=donate)
    checks = {}
    if donate:
        storage = sent.untyped_storage().data_ptr()
        arrived_in_place = y._is_view()  # what arrived is the result (a view), as without donate
        in_place = (scatter_dim, gather_dim) == (1, 2) or not arrived_in_place  # 1 -> 2 must copy
        checks["in place"] = (y.untyped_storage().data_ptr() == storage, in_place)
        y = y if arrived_in_place else y.mul_(1)
    (y.sin() * weight.chunk(size, scatter_dim)[index]).sum().backward()  # after the block: still recorded
    whole = full.clone().requires_grad_(True)
    (whole.sin() * weight).sum().backward()
    return {
        "output": (y.detach(), full.chunk(size, scatter_dim)[index]),
        "grad": (x.grad, whole.grad.chunk(size, gather_dim)[index]),
        "events": (
            [(e.op, e.name, e.phase, e.nbytes, e.group_size) for e in log.events],
            [("all_to_all", "probe", phase, x.nbytes, size) for phase in ("forward", "backward")],
        ),
        **checks,
    }


def _donated_but_saved_case(group):
    """A donated input that autograd saved after all (exp keeps its output): the backward raises, never
    reads the values the result overwrote."""
    x = _data(0, 4, 8, 12).requires_grad_(True)
    y = all_to_all(x.exp(), 1, 2, group, name="probe", donate=True)
    try:
        y.sum().backward()
    except RuntimeError as error:
        return {"message": (str(error), "one of the variables needed for gradient computation")}
    return {"message": ("no error", "one of the variables needed for gradient computation")}


def _shares_case(group, rows: int):
    """A replicated ``[rows, 3]`` tensor: each rank's share (as torch.chunk cuts, the last ones short or
    empty) through a function, the shares gathered back whole; every rank gets the whole gradient."""
    size, index = dist.get_world_size(group), dist.get_rank(group)
    seed = dist.get_process_group_ranks(group)[0]  # the same whole tensor within the group
    full, weight = _data(seed, rows, 3), _data(seed + 100, rows, 3)
    x = full.clone().requires_grad_(True)
    with recording() as log:
        mine = share_rows(x, group, name="probe in")
        y = gather_shares(mine.sin(), rows, group, name="probe out")
    (y * weight).sum().backward()
    chunk = -(-rows // size)
    return {
        "share": (mine.detach(), full[index * chunk : (index + 1) * chunk]),
        "output": (y.detach(), full.sin()),
        "grad": (x.grad, full.cos() * weight),
        "events": (
            [(e.op, e.name, e.phase, e.nbytes, e.group_size) for e in log.events],
            [
                ("all_gather", "probe out", "forward", chunk * 3 * 8, size),
                ("all_gather", "probe in", "backward", chunk * 3 * 8, size),
            ],
        ),
    }


def _reductions_case(group):
    members, rank = dist.get_process_group_ranks(group), dist.get_rank()
    size = len(members)
    checks = {}
    # sum_over_group: the sum on every rank; the backward is the identity
    x = _data(rank, 3, 5).requires_grad_(True)
    upstream = _data(1000 + rank, 3, 5)
    with recording() as log:
        total = sum_over_group(x, group, name="loss")
    (total * upstream).sum().backward()
    checks["sum"] = (total.detach(), sum(_data(r, 3, 5) for r in members))
    checks["sum grad"] = (x.grad, upstream)
    checks["sum input kept"] = (x.detach(), _data(rank, 3, 5))
    count = sum_over_group(torch.tensor(rank + 1), group)
    checks["sum int"] = (count, torch.tensor(sum(r + 1 for r in members)))
    checks["sum events"] = (
        [(e.op, e.name, e.phase, e.nbytes) for e in log.events],
        [("all_reduce", "loss", "forward", x.nbytes)],
    )

    # sum_many_grads_over_group: the identity; in the backward one all-reduce per dtype of the gradients
    # that are wanted, each back in its shape and dtype
    shapes = [((2, 3), torch.float32), ((4,), torch.float64), ((3, 1), torch.float32), ((5,), torch.float64)]
    mine = [_data(i, *shape, dtype=dtype).requires_grad_(i != 3) for i, (shape, dtype) in enumerate(shapes)]
    with recording() as log:
        same = sum_many_grads_over_group(mine, group, name="gradients")
        weighted = sum((x * _data(rank * 10 + i, *x.shape, dtype=x.dtype)).sum() for i, x in enumerate(same))
        grads = torch.autograd.grad(weighted, mine[:3])
    for i in range(len(shapes)):
        checks[f"many identity {i}"] = (same[i].detach(), mine[i].detach())
    for i, grad in enumerate(grads):
        checks[f"many grad {i}"] = (
            grad,
            sum(_data(r * 10 + i, *shapes[i][0], dtype=shapes[i][1]) for r in members),
        )
    checks["many events"] = (
        sorted((e.op, e.name, e.phase, e.nbytes, e.group_size) for e in log.events),
        sorted(("all_reduce", "gradients", "backward", n, size) for n in (4 * 6 + 4 * 3, 8 * 4)),
    )
    # reached (parameters): a tensor that no rank's backward reaches gets no gradient (None, as one process's
    # autograd leaves it), one that some ranks' reach gets their sum on every rank; whether each rank reached
    # each tensor rides in the first one's bucket
    everywhere, first_only, nowhere = (_data(100 + i, 3).requires_grad_(True) for i in range(3))
    with recording() as log:
        same = sum_many_grads_over_group([everywhere, first_only, nowhere], group, "gradients", reached=True)
        used = same[0].sum() + (same[1] * (rank + 1)).sum() if rank == members[0] else same[0].sum()
        grads = torch.autograd.grad(used, [everywhere, first_only, nowhere], allow_unused=True)
    checks["reached events"] = ([e.nbytes for e in log.events], [8 * (3 * 3 + 3)])
    checks["reached nowhere"] = (grads[2] is None, True)
    checks["reached on the first rank only"] = (
        grads[1],
        torch.full((3,), members[0] + 1.0, dtype=torch.float64),
    )
    checks["reached everywhere"] = (grads[0], torch.full((3,), float(size), dtype=torch.float64))
    # the same for shards gathered whole (an FSDP parameter): the flags ride in each rank's block
    shards = [_data(200 + i, 1, 2).requires_grad_(True) for i in range(2)]
    used, unused = all_gather_shards(shards, [size, size], group, "parameters", reached=True)
    grads = torch.autograd.grad(used.sum(), shards, allow_unused=True)
    checks["gathered, reached"] = (grads[0], torch.full((1, 2), float(size), dtype=torch.float64))
    checks["gathered, reached nowhere"] = (grads[1] is None, True)
    # a frozen shard (LoRA's base weights) gathers whole without a gradient: the backward reduce-scatters the
    # trained ones' gradients (and their flags) alone, and none is computed for the frozen one
    trained, frozen = _data(300, 1, 4).requires_grad_(True), _data(301, 1, 2)
    with recording() as log:
        used, fixed = all_gather_shards([trained, frozen], [size, size], group, "parameters", reached=True)
        (grad,) = torch.autograd.grad((used * fixed.sum()).sum(), [trained])
    checks["gathered, frozen"] = ((used.requires_grad, fixed.requires_grad), (True, False))
    frozen_sum = size * _data(301, 1, 2).sum()  # of the frozen whole: every rank's shard alike
    checks["gathered, trained"] = (grad, (size * frozen_sum).expand(1, 4))  # each rank's row gradient, summed
    checks["gathered, frozen events"] = (
        [(e.op, e.phase, e.nbytes) for e in log.events],
        [("all_gather", "forward", 8 * 6), ("reduce_scatter", "backward", 8 * size * (4 + 1))],
    )

    # scatter_sums: this rank's block of the sum over the group; the backward gathers the blocks' gradients
    whole = _data(2000 + rank, 2 * size, 3).requires_grad_(True)
    with recording() as log:
        block = scatter_sums(whole, group, name="partial sums")
    (block * _data(3000 + rank, 2, 3)).sum().backward()
    first = 2 * members.index(rank)
    checks["scatter"] = (
        block.detach(),
        sum(_data(2000 + r, 2 * size, 3) for r in members)[first : first + 2],
    )
    checks["scatter grad"] = (whole.grad, torch.cat([_data(3000 + r, 2, 3) for r in members]))
    checks["scatter events"] = (
        [(e.op, e.phase, e.nbytes) for e in log.events],
        [("reduce_scatter", "forward", whole.nbytes), ("all_gather", "backward", whole.nbytes // size)],
    )

    # all_gather_rows: every rank's tensor, stacked in group order
    row = _data(rank, 2, 3, dtype=torch.float32)
    with recording() as log:
        rows = all_gather_rows(row, group, name="fingerprint")
    checks["rows"] = (rows, torch.stack([_data(r, 2, 3, dtype=torch.float32) for r in members]))
    checks["rows events"] = (
        [(e.op, e.nbytes, e.group_size) for e in log.events],
        [("all_gather", row.nbytes, size)],
    )
    return checks


def _collective_cases():
    cases = {}
    for label, group in _groups().items():
        for scatter_dim, gather_dim in EXCHANGES:
            cases[f"{label} all_to_all {scatter_dim}->{gather_dim}"] = _all_to_all_case(
                group, scatter_dim, gather_dim
            )
            cases[f"{label} donated all_to_all {scatter_dim}->{gather_dim}"] = _all_to_all_case(
                group, scatter_dim, gather_dim, donate=True
            )
        cases[f"{label} donated but saved"] = _donated_but_saved_case(group)
        cases[f"{label} reductions"] = _reductions_case(group)
        for rows in (5, 8):  # shares of 2, 2, 1, 0 (or 3, 2) rows; even shares
            cases[f"{label} shares of {rows}"] = _shares_case(group, rows)
        try:
            all_to_all(torch.zeros(2, 3), 1, 0, group, name="q proj")
        except ValueError as error:
            cases[f"{label} uneven"] = {"message": (str(error), "q proj: dimension 1 of shape (2, 3)")}
    return cases


@pytest.mark.ranks  # starts its own ranks
@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world, request):
    for rank, cases in enumerate(request.getfixturevalue(f"ranks{world}").run(_collective_cases)):
        assert len(cases) == (1 if world == 2 else 2) * (2 * len(EXCHANGES) + 5)
        for case, checks in cases.items():
            for what, (actual, expected) in checks.items():
                where = f"rank {rank}, {case}, {what}"
                if isinstance(actual, torch.Tensor):
                    assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
                    torch.testing.assert_close(actual, expected, msg=where)
                elif what == "message" and "saved" in case:
                    assert actual.startswith(expected), where
                elif what == "message":
                    assert (
                        actual.startswith(expected)
                        and f"over {world if 'world' in case else 2} ranks" in actual
                    ), where
                else:
                    assert actual == expected, f"{where}: {actual} != {expected}"


def run_functional_exchange_as_under_compile():
    """The all-to-all's functional branch (what torch.compile traces), taken eagerly: the c10d branch's
    results, forward and backward."""
    from unittest import mock

    group = cpshard.make_mesh(cp=dist.get_world_size()).get_group("cp")
    eager = _all_to_all_case(group, 1, 2)
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        traced = _all_to_all_case(group, 1, 2)
    return {key: torch.equal(eager[key][0], traced[key][0]) for key in ("output", "grad")}


def test_functional_exchange_matches_c10d(ranks2):
    for same in ranks2.run(run_functional_exchange_as_under_compile):
        assert same == {"output": True, "grad": True}
