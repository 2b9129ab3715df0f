"""The one piece of dynamic state: which cp call, if any, is running now.

Hooks and the attention function are installed once at setup and consult this: outside a
``cp_forward`` call they step aside, so the model gives its ordinary results.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from cpshard.layouts.layout import Layout


@dataclass(frozen=True)
class CPCall:
    """What the hooks of one ``cp_forward`` call need: the mesh, its cp size and the layout."""

    mesh: object
    cp_size: int
    layout: Layout
    #: the real sequence length; tokens past it are cp padding
    length: int
    #: module path by ``id(module)``, so every collective can name the module it ran in
    module_names: dict
    #: "ulysses", "ring" or "hybrid" (Ulysses over ``ulysses`` ranks, ring across those groups)
    implementation: str = "ulysses"
    ulysses: int = 1
    #: which positions each cp rank holds (see cpshard.spec.sequence), and the padded length they split
    order: str = "contiguous"
    padded_length: int = 0
    #: the cp axis unflattened as (cp_ring, cp_ulysses), for ring and hybrid
    split_mesh: object = None
    #: the process group of the ``tp`` ranks (tensor parallelism), None when tp is 1
    tp_group: object = None
    #: the process group of the ``ep`` ranks (expert parallelism), None when ep is 1
    expert_group: object = None

    #: what every layer derives alike from the call's inputs, derived once (see :meth:`shared`)
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    def shared(self, key, make):
        """``make()``, once per call and ``key``: a value every layer would derive alike (a mask in the form
        the attention kernel keeps, the ring's block plan), so layers share one copy and one computation."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    def name_of(self, module) -> str:
        return self.module_names.get(id(module), type(module).__name__)


_ACTIVE: ContextVar[CPCall | None] = ContextVar("cpshard_active_call", default=None)


def active_call() -> CPCall | None:
    """The running cp call, or None outside ``cp_forward`` (or when cp is 1: nothing to split)."""
    call = _ACTIVE.get()
    return call if call is not None and call.cp_size > 1 else None


def current_call() -> CPCall | None:
    """The running call whatever its cp size: tensor and expert parallelism act even at cp=1."""
    return _ACTIVE.get()


@contextmanager
def running(call: CPCall):
    token = _ACTIVE.set(call)
    try:
        yield call
    finally:
        _ACTIVE.reset(token)
