"""What a collective inside a compiled decoder layer runs on, resolved before the layer runs.

torch.compile cannot hold a DeviceMesh, a process group, the comms record or the name of the module a
collective serves without specializing on them (one graph per layer) or breaking the graph. So the
cut hook, which runs eagerly before each layer, puts them into a :class:`Channel`: an opaque reference
for torch.compile (a graph input, read only by cpshard's custom ops when they run), the same type for
every layer, so one compiled graph serves them all. :class:`TracedMesh` gives compiled code the rest
of what it asks a mesh (sizes and ranks, constants that are the same for every layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

try:  # torch 2.14's names for 2.13's opaque objects (there, 2.13's warn at import)
    from torch._custom_class_base import CustomClassBase as OpaqueBase
    from torch._library.opaque_object import register_custom_class as register_opaque_type

    _REFERENCE = "symbolic"
except ImportError:  # torch 2.13
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase

    _REFERENCE = "reference"


class Channel(OpaqueBase):
    """Process groups by mesh axis, the record they report to, the module path that names their
    collectives and the running call (for the ops that derive their plan from it when they run)."""

    def __init__(self, groups: Mapping, path: str, recorder, call=None):
        self.groups, self.path, self.recorder, self.call = groups, path, recorder, call


register_opaque_type(Channel, typ=_REFERENCE)


@dataclass(frozen=True)
class TracedGroup:
    """One mesh axis's process group as compiled code holds it: its size and this rank's place in it
    (constants), the group itself behind the channel."""

    channel: Channel
    axis: str
    ranks: int
    rank: int

    def size(self) -> int:
        return self.ranks


@dataclass(frozen=True)
class TracedMesh:
    """The parts of a DeviceMesh that cp attention asks for, in a form torch.compile can trace:
    ``mesh[axis].size()``, ``mesh_dim_names`` with ``size(dim)``, ``get_local_rank(axis)`` and
    ``get_group(axis)``."""

    channel: Channel
    #: ``((axis, size, this rank's index), ...)``
    axes: tuple[tuple[str, int, int], ...]

    def get_group(self, axis: str) -> TracedGroup:
        for name, size, rank in self.axes:
            if name == axis:
                return TracedGroup(self.channel, axis, size, rank)
        raise KeyError(f"mesh axis {axis!r} is not one of {[name for name, _, _ in self.axes]}")

    def __getitem__(self, axis: str) -> TracedGroup:
        return self.get_group(axis)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.axes)

    def size(self, dim: int) -> int:
        return self.axes[dim][1]

    def get_local_rank(self, axis: str) -> int:
        return self.get_group(axis).rank
