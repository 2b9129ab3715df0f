"""A record of the collectives launched while a :func:`recording` is open.

Every collective in :mod:`cpshard.comm.collectives` reports here: its op, a name (the module or
purpose it serves), the phase (forward or backward) and the bytes of its input tensor on
this rank. Nothing is recorded when no recording is open.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CommEvent:
    """One collective on this rank."""

    op: str
    name: str
    phase: str
    nbytes: int
    group_size: int


@dataclass
class CommsLog:
    """The collectives recorded on this rank, in launch order."""

    events: list[CommEvent] = field(default_factory=list)
    #: the recording this one is nested in, which records every event too
    parent: CommsLog | None = field(default=None, repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.events)

    def bytes_by(self, key: str) -> dict[str, int]:
        """Bytes summed per value of one event field (``op``, ``name`` or ``phase``)."""
        totals: dict[str, int] = defaultdict(int)
        for event in self.events:
            totals[getattr(event, key)] += event.nbytes
        return dict(totals)

    def bytes_by_parallelism(self) -> dict[str, int]:
        """Bytes summed per parallelism served (:func:`parallelism_of`): cp, fsdp, replicas, tp, ep, other."""
        totals = dict.fromkeys(("cp", "fsdp", "replicas", "tp", "ep", "other"), 0)
        for event in self.events:
            totals[parallelism_of(event)] += event.nbytes
        return totals

    def count_by(self, key: str) -> dict[str, int]:
        """Number of collectives per value of one event field."""
        counts: dict[str, int] = defaultdict(int)
        for event in self.events:
            counts[getattr(event, key)] += 1
        return dict(counts)


#: collectives that serve neither the sequence split nor a parameter layout, by name
_BOOKKEEPING = ("loss", "token count", "batch fingerprint")


def parallelism_of(event: CommEvent) -> str:
    """Which parallelism a collective serves, by the name its caller gave it: the FSDP gather and its
    reduce-scatter ("parameters"), the gradient all-reduce over replicas ("gradients"), tensor
    parallelism ("tp ..."), the experts' token exchange ("...experts..."), the loss and batch checks
    ("other"); everything else moves sequences for context parallelism."""
    if event.name == "parameters":
        return "fsdp"
    if event.name == "gradients":
        return "replicas"
    if event.name.startswith("tp "):
        return "tp"
    if "experts" in event.name:
        return "ep"
    return "other" if event.name in _BOOKKEEPING else "cp"


_ACTIVE: ContextVar[CommsLog | None] = ContextVar("cpshard_comms_log", default=None)


def active_log() -> CommsLog | None:
    """The open recording, if any (collectives keep it to report their backward too)."""
    return _ACTIVE.get()


@contextmanager
def recording():
    """Record every cpshard collective launched inside the block; yields the :class:`CommsLog`."""
    log = CommsLog(parent=_ACTIVE.get())
    token = _ACTIVE.set(log)
    try:
        yield log
    finally:
        _ACTIVE.reset(token)


def record(log: CommsLog | None, op: str, name: str, phase: str, tensor, group_size: int) -> None:
    """Append one event to ``log`` and every recording it is nested in (no-op without a log)."""
    if log is None:
        return
    event = CommEvent(op, name, phase, tensor.numel() * tensor.element_size(), group_size)
    while log is not None:
        log.events.append(event)
        log = log.parent
