"""``trace_comms``: every collective a function launches, forward and backward, beside the optimum.

The collectives report themselves to :mod:`cpshard.comms`; this groups them by module path, op and
phase. The optimum comes from the layout, not from what ran: each ``cp_forward`` the function makes
is seen at its model's forward (batch size, padded length, dtype, parameters), and
:mod:`cpshard.debug.analytic` says what Ulysses must move for it: per attention module, one
all-to-all each of q, k, v and the output forward, the same backward when a backward ran; and,
when gradients are reduced, every parameter's gradient once (one bucket per dtype).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_hook

from cpshard.comms import CommEvent, recording
from cpshard.context import CPCall, active_call
from cpshard.debug.analytic import attention_paths, attention_steps, mesh_sizes, token_ways
from cpshard.debug.table import grouped, table

PHASES = ("forward", "backward")
#: the name :func:`cpshard.value_and_grad` gives its gradient all-reduce
GRADIENTS = "gradients"


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
    """One ``cp_forward``, as its model's forward saw it: what the optimum depends on."""

    call: CPCall
    config: object
    tokens: int  # per rank, after the cut
    dtype: torch.dtype
    #: gradient bytes per dtype; None when parameters are DTensors (their reduction is not this one)
    param_bytes: dict | None

    @classmethod
    def of(cls, call: CPCall, model, kwargs: dict) -> _Run:
        inputs = kwargs.get("input_ids")
        inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
        params = list(model.parameters())
        param_bytes: dict | None = defaultdict(int)
        for p in params:
            param_bytes[p.dtype] += p.numel() * p.element_size()
        if any(isinstance(p, DTensor) for p in params):
            param_bytes = None
        dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
        tokens = inputs.shape[0] * inputs.shape[1] // token_ways(call.layout, mesh_sizes(call.mesh))
        return cls(call, model.config, tokens, dtype, param_bytes and dict(param_bytes))


def split_name(name: str, modules: set[str]) -> tuple[str, str]:
    """``("model.layers.3.self_attn", "q")`` from the event name ``"model.layers.3.self_attn q"``;
    a name that starts with no module path (``"loss"``, ``"batch fingerprint"``) is its own group."""
    head, _, part = name.partition(" ")
    if part and (head in modules or "." in head):
        return head, part
    return name, ""


def optimum(runs: list[_Run], phases: set[str], groups: set[tuple]) -> dict[tuple, list[int]]:
    """(module, op, phase) -> [count, bytes] that the layout needs for ``runs``."""
    expected: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for run in runs:
        steps = attention_steps(run.config, run.call.layout, mesh_sizes(run.call.mesh), run.dtype)
        if any(s.bytes_per_token is None for s in steps):
            continue
        count, per_token = sum(s.collectives for s in steps), sum(s.bytes_per_token for s in steps)
        for path in attention_paths(run.call.module_names.values(), run.call.layout):
            for phase in (p for p in PHASES if p in phases):
                expected[(path, "all_to_all", phase)][0] += count
                expected[(path, "all_to_all", phase)][1] += per_token * run.tokens
        if run.param_bytes is not None and (GRADIENTS, "all_reduce", "backward") in groups:
            expected[(GRADIENTS, "all_reduce", "backward")][0] += len(run.param_bytes)
            expected[(GRADIENTS, "all_reduce", "backward")][1] += sum(run.param_bytes.values())
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
            (g.module, g.op, g.phase, g.count, grouped(g.nbytes),
             "" if g.optimum_count is None else g.optimum_count,
             "" if g.optimum_bytes is None else grouped(g.optimum_bytes), g.verdict)
            for g in self.groups
        ]
        rows.append(("total", "", "", len(self.events), grouped(self.total_bytes), "", "", ""))
        header = ("module", "op", "phase", "count", "bytes", "optimum count", "optimum bytes", "")
        return table(rows, header, right=frozenset({3, 4, 5, 6}))


def _group(events: list[CommEvent], runs: list[_Run]) -> list[Group]:
    modules = {name for run in runs for name in run.call.module_names.values()}
    observed: dict[tuple, list[int]] = {}
    for event in events:
        key = (split_name(event.name, modules)[0], event.op, event.phase)
        entry = observed.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += event.nbytes
    expected = optimum(runs, {e.phase for e in events} | {"forward"}, set(observed))
    keys = list(observed) + [key for key in expected if key not in observed]
    first = {}
    for module, _, _ in keys:
        first.setdefault(module, len(first))
    keys.sort(key=lambda k: (first[k[0]], PHASES.index(k[2]) if k[2] in PHASES else len(PHASES)))
    return [Group(*key, *observed.get(key, (0, 0)), *expected.get(key, (None, None))) for key in keys]


def trace_comms(fn, /, *args, **kwargs) -> CommsReport:
    """Run ``fn(*args, **kwargs)`` and report every cpshard collective it launched on this rank,
    forward and backward; the value of ``fn`` is ``report.result``."""
    runs: list[_Run] = []

    def seen(module, module_args, module_kwargs, output):
        call = active_call()
        if call is not None and call.name_of(module) == "":  # the model itself, inside a cp call
            runs.append(_Run.of(call, module, module_kwargs))

    handle = register_module_forward_hook(seen, with_kwargs=True)
    try:
        with recording() as log:
            result = fn(*args, **kwargs)
    finally:
        handle.remove()
    return CommsReport(list(log.events), _group(log.events, runs), result)
