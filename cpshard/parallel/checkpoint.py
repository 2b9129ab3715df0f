"""Checkpoints of parameter dicts: distributed (torch DCP), and gathered into a transformers folder.

DCP stores each tensor with its global shape and every rank's piece, so a checkpoint saved under one
mesh loads under any other, and on one process with no process group at all. Keys are the
``params_of`` names.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from cpshard.parallel.fsdp import block_shape, full_tensors


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when there is no process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def save_checkpoint(params: dict, path: str | os.PathLike) -> None:
    """Write ``params`` (plain tensors and DTensors) to the folder ``path``; every rank of the default group calls it."""
    with _quiet_single_process():
        dcp.save(
            {name: value.detach() for name, value in params.items()}, checkpoint_id=path, no_dist=_no_dist()
        )


def _check_against(path, params: dict) -> None:
    """Every key of ``params`` is in the checkpoint with its global shape and dtype (raised on every rank alike)."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = [name for name in params if name not in stored]
    if missing:
        raise KeyError(f"checkpoint {os.fspath(path)!r} has no {', '.join(missing)}")
    for name, value in params.items():
        meta = stored[name]
        shape, dtype = (
            tuple(getattr(meta, "size", ())),
            getattr(getattr(meta, "properties", None), "dtype", None),
        )
        if shape != tuple(value.shape) or dtype != value.dtype:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} holds {name} as {dtype} {list(shape)}, "
                f"the target is {value.dtype} {list(value.shape)}; load into a target like the saved tensor, then convert"
            )


def load_checkpoint(path: str | os.PathLike, params: dict) -> dict:
    """New tensors like ``params`` (type, shape, dtype, mesh, placements) holding the saved values bit for bit.

    ``params`` itself is left as it was; the checkpoint may hold more keys than it asks for."""
    _check_against(path, params)
    targets = {name: torch.empty_like(value.detach()) for name, value in params.items()}
    with _quiet_single_process():
        dcp.load(targets, checkpoint_id=path, no_dist=_no_dist())
    return targets


def save_pretrained(model, params: dict, folder: str | os.PathLike) -> None:
    """``model``'s config and class with the weights of ``params``, gathered whole, as a folder that
    ``from_pretrained`` loads. Every rank gathers; rank 0 writes; an error there is raised on every rank."""
    sharded = {name: value for name, value in params.items() if isinstance(value, DTensor)}
    blocks = {name: value for name, value in sharded.items() if block_shape(value) != value.shape}  # tp, ep
    fsdp_only = {name: value for name, value in sharded.items() if name not in blocks}
    with torch.no_grad():
        gathered = {
            **full_tensors(fsdp_only, name="save_pretrained"),
            **{n: v.full_tensor() for n, v in blocks.items()},
        }
        weights = {**params, **gathered}
    tensors = {name: value.detach() for name, value in weights.items()}
    param_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {name: value for name, value in model.state_dict().items() if name not in param_names}
    error = None
    if _no_dist() or dist.get_rank() == 0:
        try:
            model.save_pretrained(folder, state_dict={**buffers, **tensors})
        except Exception as caught:  # noqa: BLE001 - told to every rank below
            error = caught
    if not _no_dist():
        told = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(told, src=0)
        if told[0] is not None and error is None:
            raise RuntimeError(f"save_pretrained failed on rank 0: {told[0]}")
    if error is not None:
        raise error
