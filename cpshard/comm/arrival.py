"""A collective whose peers do not all arrive: a clear error on the ranks that wait, not a silent hang.

A rank that raised elsewhere, hangs or exited leaves the others waiting in their next collective until the
group's timeout (torch's default: 30 minutes for gloo, 10 for nccl; :func:`cpshard.make_mesh` takes
another). When the backend gives up (a timeout, or the peer's connection gone), cpshard raises
:class:`CollectiveError` naming the collective (its module and what it moves), the mesh axis and the reason.
"""

from __future__ import annotations

from contextlib import contextmanager

#: what gloo and nccl say when a peer did not arrive or is gone
_NOT_ARRIVED = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer")


class CollectiveError(RuntimeError):
    """A cpshard collective did not complete because a rank of its group did not arrive."""


def axis_of(group) -> str:
    """The mesh axis a process group serves (DeviceMesh names its groups ``mesh_<axis>``)."""
    description = getattr(group, "group_desc", "") or ""
    return description.removeprefix("mesh_") or "the default group"


@contextmanager
def arriving(op: str, name: str, group):
    """Run one collective; a backend error saying a peer did not arrive becomes a :class:`CollectiveError`
    naming ``op``, ``name`` and the group's mesh axis (other errors pass as they are)."""
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, CollectiveError) or not any(s in str(error).lower() for s in _NOT_ARRIVED):
            raise
        raise CollectiveError(
            f"cpshard's {op} {name or '(unnamed)'} over the mesh axis {axis_of(group)!r} did not complete: a "
            "rank of its group did not arrive (it raised elsewhere, hangs, or its process exited) within the "
            f"group's timeout (cpshard.make_mesh(timeout=...) sets it). The backend said: {str(error)[:300]}"
        ) from error
