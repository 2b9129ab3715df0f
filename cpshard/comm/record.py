"""A record of the collectives launched while a :func:`recording` is open.

Every collective in :mod:`cpshard.comm.collectives` reports here: its op, a name (the module or
purpose it serves), the phase (forward or backward), the bytes of its input tensor on this rank, and
the parallelism it serves. The parallelism is said where the collective is launched, by the
:func:`serving` block around it (as a JAX collective names its axis), and travels with the
collective into its backward. Nothing is recorded when no recording is open.
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
    #: the parallelism served, one of :data:`PARALLELISMS`
    parallelism: str = "cp"


@dataclass(frozen=True)
class Expected:
    """The analytic optimum of one module's collectives of one op and phase on this rank, declared where
    their sizes are known from the shapes alone (a linear-attention layer's kernel inputs), for
    :func:`cpshard.debug.trace_comms` to set beside what ran."""

    module: str
    op: str
    phase: str
    count: int
    nbytes: int


@dataclass
class CommsLog:
    """The collectives recorded on this rank, in launch order, and the optimum declared for some."""

    events: list[CommEvent] = field(default_factory=list)
    expected: list[Expected] = field(default_factory=list)
    #: ``(call, model, inputs)`` of each cp call run inside the recording (:func:`note_call`), whose optimum a
    #: report works out
    calls: list[tuple] = field(default_factory=list, repr=False, compare=False)
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
        """Bytes summed per parallelism served, every one of :data:`PARALLELISMS` present."""
        return {**dict.fromkeys(PARALLELISMS, 0), **self.bytes_by("parallelism")}

    def count_by(self, key: str) -> dict[str, int]:
        """Number of collectives per value of one event field."""
        counts: dict[str, int] = defaultdict(int)
        for event in self.events:
            counts[getattr(event, key)] += 1
        return dict(counts)


#: what a collective can serve: the sequence split, the FSDP gather and its reduce-scatter, the gradient
#: all-reduce over replicas, tensor and expert parallelism, and bookkeeping (the loss, token counts,
#: batch checks)
PARALLELISMS = ("cp", "fsdp", "replicas", "tp", "ep", "other")

_SERVING: ContextVar[str] = ContextVar("cpshard_serving", default="cp")


@contextmanager
def serving(parallelism: str):
    """Collectives launched inside the block (a ``with`` or a decorator) serve ``parallelism``;
    outside every block they serve cp."""
    if parallelism not in PARALLELISMS:
        raise ValueError(f"serving({parallelism!r}): a parallelism is one of {PARALLELISMS}")
    token = _SERVING.set(parallelism)
    try:
        yield
    finally:
        _SERVING.reset(token)


@dataclass(frozen=True)
class Recorder:
    """Where one collective reports: the open recording, and the parallelism its launch serves
    (a collective takes its recorder at launch, so that its backward's events land in the same place)."""

    log: CommsLog
    parallelism: str


_ACTIVE: ContextVar[CommsLog | None] = ContextVar("cpshard_comms_log", default=None)


def active_log() -> CommsLog | None:
    """The open recording, if any."""
    return _ACTIVE.get()


def active_recorder() -> Recorder | None:
    """The recorder for a collective launched now, if a recording is open."""
    log = _ACTIVE.get()
    return None if log is None else Recorder(log, _SERVING.get())


@contextmanager
def recording():
    """Record every cpshard collective launched inside the block; yields the :class:`CommsLog`."""
    log = CommsLog(parent=_ACTIVE.get())
    token = _ACTIVE.set(log)
    try:
        yield log
    finally:
        _ACTIVE.reset(token)


def record(recorder: Recorder | None, op: str, name: str, phase: str, tensor, group_size: int) -> None:
    """Append one event to the recorder's log and every recording it is nested in (no-op without one)."""
    if recorder is None:
        return
    nbytes = tensor.numel() * tensor.element_size()
    event = CommEvent(op, name, phase, nbytes, group_size, recorder.parallelism)
    log = recorder.log
    while log is not None:
        log.events.append(event)
        log = log.parent


def note_call(call, model, inputs: dict) -> None:
    """Declare, in the open recording and every one it is nested in, a cp ``call`` of ``model`` on ``inputs``
    (whether the model's own forward runs or its decoder alone, as with the head run with the loss); no-op
    without a recording."""
    log = _ACTIVE.get()
    while log is not None:
        log.calls.append((call, model, inputs))
        log = log.parent


def expect(module: str, op: str, phase: str, count: int, nbytes: int) -> None:
    """Declare :class:`Expected` in the open recording and every one it is nested in (no-op without one)."""
    log = _ACTIVE.get()
    while log is not None:
        log.expected.append(Expected(module, op, phase, count, nbytes))
        log = log.parent
