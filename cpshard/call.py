"""The call now running, if any: the one piece of ambient state in cpshard, and why it exists.

cp_forward calls the model's own forward, which calls the attention function through transformers'
registry, the decoder layers' forward pre-hooks and the experts function. None of those can take an
extra argument from cp_forward, so they find the running call's :class:`CallPlan` here. Outside a
``cp_forward`` call there is none and every installed piece steps aside: the model gives its ordinary
results. Activation checkpointing recomputes layers after cp_forward returned, so
:mod:`cpshard.runtime.recompute` re-enters the call for them.

Generation adds two things the attention function must find the same way: a prefill's ``CallPlan``
carries ``kv_sink``, where each layer leaves this rank's keys and values (and ``state_sink``, where each
recurrent layer leaves the state it hands on), and a decode step (one token
per row, the sequence not split, so no CallPlan and every other hook steps aside) is found through
:func:`active_decode`.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from cpshard.comm.channel import Channel, TracedMesh
from cpshard.comm.record import active_recorder
from cpshard.layouts.layout import Layout

#: the keyword under which a compiled decoder layer's attention receives its :class:`TracedCall`
TRACED_KEY = "cpshard_call"


@dataclass(frozen=True)
class CallPlan:
    """How one ``cp_forward`` call splits its work: what the installed hooks and functions read."""

    mesh: DeviceMesh
    cp_size: int
    layout: Layout
    #: module path by ``id(module)``, so every collective can name the module it ran in
    module_names: Mapping[int, str]
    #: "ulysses", "ring" or "hybrid" (Ulysses over ``ulysses`` ranks, ring across those groups)
    implementation: str
    ulysses: int
    #: which positions each cp rank holds (see :mod:`cpshard.spec.sequence`)
    order: str
    #: the real sequence length; tokens past it are cp padding, up to ``padded_length``
    length: int
    padded_length: int
    #: the cp axis unflattened as (cp_ring, cp_ulysses), for ring and hybrid
    split_mesh: DeviceMesh | None = None
    #: ``mesh["cp"]``, which the outputs' DTensors live on (sliced outside a compiled step: inductor cannot)
    cp_mesh: DeviceMesh | None = None
    #: the process group of the ``tp`` ranks (tensor parallelism), None when tp is 1
    tp_group: ProcessGroup | None = None
    #: the process group of the ``ep`` ranks (expert parallelism), None when ep is 1
    expert_group: ProcessGroup | None = None
    #: how the experts layer runs beside tp: "dispatch" or "all_reduce" (see :mod:`cpshard.parallel.experts`)
    expert_plan: str = "dispatch"
    #: a prefill's keys and values as each attention module sees them (this rank's share), by ``id(module)``
    kv_sink: dict | None = field(default=None, compare=False, repr=False)
    #: a prefill's recurrent states as each linear-attention slot hands them on, by slot path
    state_sink: dict | None = field(default=None, compare=False, repr=False)
    #: whether the decoder layers are compiled: their attention then gets a :class:`TracedCall` (see there)
    traced: bool = False
    #: the memory modes of ``make_cp_forward``: the MLP a block of this many tokens at a time (None: whole),
    #: and each attention module under a checkpoint of its own
    mlp_tile: int | None = None
    attention_recompute: bool = False
    #: Ulysses' attention a block of queries at a time within this many bytes of scores (None: whole)
    attention_block_bytes: int | None = None
    #: how linear-attention layers run: "auto", "state_passing" or "head_split" (:mod:`cpshard.recurrent`)
    recurrent: str = "auto"
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

    def key_length(self, mask) -> int:
        """How many of the keys under ``mask`` are real (the rest are cp padding)."""
        return self.length

    def traced_for(self, module) -> TracedCall:
        """This call as the compiled layer holding attention ``module`` sees it."""
        meshes = [mesh for mesh in (self.mesh, self.split_mesh) if mesh is not None]
        groups = {name: mesh.get_group(name) for mesh in meshes for name in _cp_axes(mesh)}
        channel = Channel(groups, self.name_of(module), active_recorder(), self)
        traced = [
            TracedMesh(
                channel,
                tuple((name, mesh[name].size(), mesh.get_local_rank(name)) for name in _cp_axes(mesh)),
            )
            for mesh in meshes
        ]
        return TracedCall(self.implementation, self.ulysses, self.cp_size, self.layout, traced[0], traced[-1])


def _cp_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(name for name in mesh.mesh_dim_names if name.startswith("cp"))


@dataclass(frozen=True)
class TracedCall:
    """The running call as a compiled decoder layer sees it, an explicit argument instead of ambient state.

    What attention reads are constants, the same for every layer and every call of one configuration
    (torch.compile guards on them, so one graph serves all layers); the process groups, the record and
    the module path that differ per layer sit behind the meshes' opaque :class:`Channel`, read only when
    the collectives run. Module names are therefore empty here: the channel prepends its path."""

    implementation: str
    ulysses: int
    cp_size: int
    layout: Layout
    mesh: TracedMesh
    split_mesh: TracedMesh

    def name_of(self, module) -> str:
        return ""

    def key_length(self, mask) -> int:
        """The cut hook cut Ulysses' mask to the real keys: a size that compiled code keeps dynamic, where
        the length as a constant would recompile for every length."""
        return mask.shape[-1]

    def shared(self, key, make):
        return make()


_ACTIVE: ContextVar[CallPlan | None] = ContextVar("cpshard_active_call", default=None)


def split_call() -> CallPlan | None:
    """The running call where it splits the sequence (cp > 1), else None: what the cut, the attention and
    the probe act on (at cp = 1 there is nothing to split)."""
    call = _ACTIVE.get()
    return call if call is not None and call.cp_size > 1 else None


def current_call() -> CallPlan | None:
    """The running call whatever its cp size: tensor and expert parallelism act even at cp=1."""
    return _ACTIVE.get()


@contextmanager
def running(call: CallPlan | None):
    """``call`` as the running call inside; None: no call, for what cp runs whole on every rank alike inside
    one (BLT's patcher and its cross-attention over gathered states: the model's own attention)."""
    token = _ACTIVE.set(call)
    try:
        yield call
    finally:
        _ACTIVE.reset(token)


_DECODING: ContextVar[object | None] = ContextVar("cpshard_decode_step", default=None)


def active_decode():
    """The running decode step (:class:`cpshard.attention.decode.DecodeStep`), or None."""
    return _DECODING.get()


@contextmanager
def decoding(step):
    token = _DECODING.set(step)
    try:
        yield step
    finally:
        _DECODING.reset(token)
