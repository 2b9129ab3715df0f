"""``trace_comms``: every collective a function launches, forward and backward, beside the optimum.

The collectives report themselves to :mod:`cpshard.comm.record`; this groups them by module path, op and
phase. The optimum comes from :mod:`cpshard.debug.optimum`, not from what ran: each ``cp_forward`` the
function makes is seen at its model's forward (batch size, padded length, dtype, parameters), and
for a Ulysses call that says, per attention module, one all-to-all of q, k and v together and one of
the output forward, the same backward when a backward ran; every gradient once (one bucket per dtype) when
gradients are reduced (in ``backward()``'s, with one element per parameter saying which ranks reached it),
and the fp32 loss once. Ring and hybrid calls get no optimum here. A
linear-attention layer declares its own (:func:`cpshard.comm.record.expect`: the analytic bytes of the
scheme it chose, from its kernel's input shapes).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
from torch.distributed.tensor import DTensor

from cpshard.call import CallPlan
from cpshard.comm.record import CommEvent, Expected, recording
from cpshard.debug.analytic import attention_paths, head_dim, value_head_dim
from cpshard.debug.optimum import CommOptimum, tp_sums_optimum, ulysses_optimum
from cpshard.debug.table import grouped, table
from cpshard.layouts.layout import gathers_keys
from cpshard.layouts.structure import submodule, text_config
from cpshard.parallel.mesh import mesh_size
from cpshard.parallel.placement import style_of
from cpshard.parallel.tensor import tensor_parallel_sums

PHASES = ("forward", "backward")
#: the names cpshard's forward and :func:`cpshard.value_and_grad` give their reductions
GRADIENTS, LOSS = "gradients", "loss"


@dataclass(frozen=True)
class Group:
    """The collectives of one module, op and phase; the optimum where the layout states one."""

    module: str
    op: str
    phase: str
    count: int
    nbytes: int
    optimum_count: int | None = None
    optimum_bytes: int | None = None

    @property
    def verdict(self) -> str:
        """``ok``, ``DIFFERS`` from the optimum, or empty where none is known."""
        if self.optimum_bytes is None:
            return ""
        return "ok" if (self.count, self.nbytes) == (self.optimum_count, self.optimum_bytes) else "DIFFERS"


@dataclass(frozen=True)
class _Run:
    """One Ulysses ``cp_forward``, as its model's forward saw it, and the optimum it implies."""

    #: the attention modules that run Ulysses: not those whose keys are gathered whole (sparse attention,
    #: which declares its own optimum, :mod:`cpshard.attention.sparse`)
    attention_paths: tuple[str, ...]
    optimum: CommOptimum
    #: how many gradient buckets (one per dtype); None when parameters are DTensors (reduced otherwise)
    buckets: int | None
    #: the parameters' dtypes
    dtypes: frozenset = frozenset()
    #: what ``backward()`` reduces: the parameters that require a gradient (a frozen one has none to sum),
    #: their bytes, their buckets (one per dtype), and whether each rank reached each of them, one element
    #: of the first one's dtype each (:func:`cpshard.comm.collectives._reached_sums`)
    trained_bytes: int = 0
    trained_buckets: int = 0
    reached_bytes: int = 0
    #: ``((event name, phase), (count, bytes))`` of the sums over tp (tp > 1): of the residual stream, and of
    #: each trained per-head weight's gradient
    tp_sums: tuple = ()

    @classmethod
    def of(cls, call: CallPlan, model, kwargs: dict) -> _Run | None:
        inputs = kwargs.get("input_ids")
        inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
        if inputs is None or getattr(call, "implementation", "ulysses") != "ulysses":
            return None
        if call.layout.sizes_path:  # stacks of sizes of their own (BLT's bytes and patches): no one optimum
            return None
        params, config, layout = list(model.parameters()), text_config(model), call.layout
        floating = [p for p in params if p.is_floating_point()]
        tp = mesh_size(call.mesh, "tp")
        heads, kv_heads = layout.tp_rank_head_counts(config, tp)
        itemsize = floating[0].element_size() if floating else 4
        optimum = ulysses_optimum(
            batch=inputs.shape[0],
            length=inputs.shape[1],
            cp=call.cp_size,
            layers=1,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim(config, layout),
            value_head_dim=value_head_dim(config, layout),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            itemsize=itemsize,
        )
        buckets = None if any(isinstance(p, DTensor) for p in params) else len({p.dtype for p in params})
        dtypes = frozenset(p.dtype for p in params)
        paths = [
            path for path in attention_paths(model, layout) if not gathers_keys(model.get_submodule(path))
        ]
        trained = [p for p in params if p.requires_grad]
        trained_bytes = sum(p.numel() * p.element_size() for p in trained)
        reached = len(trained) * trained[0].element_size() if trained else 0
        tp_sums = _tp_sums(model, layout, inputs.shape, call.cp_size, itemsize) if tp > 1 else {}
        return cls(
            tuple(paths),
            optimum,
            buckets,
            dtypes,
            trained_bytes,
            len({p.dtype for p in trained}),
            reached,
            tuple(tp_sums.items()),
        )


def _tp_sums(model, layout, shape: tuple, cp: int, itemsize: int) -> dict[tuple[str, str], tuple[int, int]]:
    """``(event name, phase) -> (count, bytes)`` of the sums over tp a call of inputs of ``shape`` makes: the
    residual stream's (:func:`tensor_parallel_sums`), and each trained per-head weight's gradient, whole.
    With frozen weights autograd skips the input gradients' sums upstream of every trained one, which this
    does not work out: those are counted where every parameter trains."""
    every_trains = all(p.requires_grad for p in model.parameters())
    hidden = getattr(text_config(model), "hidden_size", None)  # the stream's width; without it, no optimum
    layers = submodule(model, layout.decoder_layers) if hidden else None
    sums = [
        (name, phase)
        for name, phase, _ in tensor_parallel_sums(layers or (), layout)
        if phase == "forward" or every_trains
    ]
    batch, length = shape[:2]
    stream = tp_sums_optimum(sums, batch=batch, length=length, cp=cp, hidden=hidden or 0, itemsize=itemsize)
    per_head = {
        (f"tp {name}", "backward"): (1, p.numel() * p.element_size())
        for name, p in model.named_parameters()
        if p.requires_grad and style_of(name, layout) == "per_head"
    }
    return {**stream, **per_head}


def split_name(name: str, modules: set[str]) -> tuple[str, str]:
    """``("model.layers.3.self_attn", "q")`` from the event name ``"model.layers.3.self_attn q"``;
    a name that starts with no module path (``"loss"``, ``"batch fingerprint"``) is its own group."""
    head, _, part = name.partition(" ")
    if part and (head in modules or "." in head):
        return head, part
    return name, ""


def optimum(runs: list[_Run], declared: list[Expected], groups: set[tuple]) -> dict[tuple, list[int]]:
    """(module, op, phase) -> [count, bytes] that the runs and the ``declared`` optima need. Backward,
    gradients and the loss are expected only where ``groups`` (what was observed) shows that such a pass
    or reduction ran; a loss not reduced apart rode with the gradients (:func:`cpshard.value_and_grad`)."""
    expected: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    backward = any(phase == "backward" for _, _, phase in groups)

    def add(key: tuple, count: int, nbytes: int) -> None:
        expected[key][0] += count
        expected[key][1] += nbytes

    for one in declared:
        if backward or one.phase != "backward":
            add((one.module, one.op, one.phase), one.count, one.nbytes)

    for run in runs:
        per_phase = (
            run.optimum.all_to_all // 2
        )  # ulysses_optimum counts forward and backward, here of one layer
        for path in run.attention_paths:  # q, k and v in one all-to-all, the output in another
            add((path, "all_to_all", "forward"), 2, per_phase)
            if backward:
                add((path, "all_to_all", "backward"), 2, per_phase)
        loss_apart = (LOSS, "all_reduce", "forward") in groups
        if run.buckets is not None and (GRADIENTS, "all_reduce", "backward") in groups:
            if loss_apart:
                add(
                    (GRADIENTS, "all_reduce", "backward"),
                    run.trained_buckets,
                    run.trained_bytes + run.reached_bytes,
                )
            else:  # value_and_grad sums the fp32 loss with the gradients
                count = len(run.dtypes | {torch.float32})
                add((GRADIENTS, "all_reduce", "backward"), count, run.optimum.gradients + run.optimum.loss)
        if loss_apart:
            add((LOSS, "all_reduce", "forward"), 1, run.optimum.loss)
        for (name, phase), (count, nbytes) in run.tp_sums:
            if backward or phase != "backward":
                add((name, "all_reduce", phase), count, nbytes)
    return dict(expected)


@dataclass
class CommsReport:
    """What :func:`trace_comms` saw on this rank: the events, their groups, and ``fn``'s result."""

    events: list[CommEvent]
    groups: list[Group]
    result: object = field(default=None, repr=False)

    @property
    def total_bytes(self) -> int:
        """Bytes of every collective's input on this rank."""
        return sum(event.nbytes for event in self.events)

    @property
    def matches_optimum(self) -> bool:
        """Every group with a known optimum has exactly its count and bytes."""
        return all(group.verdict != "DIFFERS" for group in self.groups)

    def _totals(self, key: str) -> dict[str, dict[str, int]]:
        totals: dict[str, dict[str, int]] = {}
        for group in self.groups:
            entry = totals.setdefault(getattr(group, key), {"count": 0, "bytes": 0})
            entry["count"] += group.count
            entry["bytes"] += group.nbytes
        return totals

    def as_dict(self) -> dict:
        """Plain data for programs: totals, per module, per op, per phase, and every group."""
        return {
            "total_bytes": self.total_bytes,
            "total_count": len(self.events),
            "by_module": self._totals("module"),
            "by_op": self._totals("op"),
            "by_phase": self._totals("phase"),
            "groups": [asdict(group) for group in self.groups],
            "matches_optimum": self.matches_optimum,
        }

    def __str__(self) -> str:
        rows = [
            (
                g.module,
                g.op,
                g.phase,
                g.count,
                grouped(g.nbytes),
                "" if g.optimum_count is None else g.optimum_count,
                "" if g.optimum_bytes is None else grouped(g.optimum_bytes),
                g.verdict,
            )
            for g in self.groups
        ]
        rows.append(("total", "", "", len(self.events), grouped(self.total_bytes), "", "", ""))
        header = ("module", "op", "phase", "count", "bytes", "optimum count", "optimum bytes", "verdict")
        return table(rows, header, right=frozenset({3, 4, 5, 6}))


def _group(
    events: list[CommEvent], runs: list[_Run], declared: list[Expected], modules: set[str]
) -> list[Group]:
    observed: dict[tuple, list[int]] = {}
    for event in events:
        key = (split_name(event.name, modules)[0], event.op, event.phase)
        entry = observed.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += event.nbytes
    expected = optimum(runs, declared, set(observed))
    keys = list(observed) + [key for key in expected if key not in observed]
    first = {}
    for module, _, _ in keys:
        first.setdefault(module, len(first))
    keys.sort(key=lambda k: (first[k[0]], PHASES.index(k[2]) if k[2] in PHASES else len(PHASES)))
    return [Group(*key, *observed.get(key, (0, 0)), *expected.get(key, (None, None))) for key in keys]


def trace_comms(fn, /, *args, **kwargs) -> CommsReport:
    """Run ``fn(*args, **kwargs)`` and report every cpshard collective it launched on this rank,
    forward and backward; the value of ``fn`` is ``report.result``."""
    with recording() as log:
        result = fn(*args, **kwargs)
    runs: list[_Run] = []
    modules: set[str] = set()
    for call, model, inputs in log.calls:  # every cp call the recording saw, that splits the sequence
        if call.cp_size > 1:
            modules.update(call.module_names.values())
            run = _Run.of(call, model, inputs)
            runs.extend([run] if run else [])
    return CommsReport(list(log.events), _group(log.events, runs, log.expected, modules), result)
