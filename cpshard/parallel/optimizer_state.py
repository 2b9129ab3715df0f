"""A torch optimizer's state, its per-parameter tensors DTensors like their parameters, through cpshard's
checkpoints: each rank writes its own shards (``save_checkpoint``, torch DCP with a verified manifest) and a
resume reads them into tensors placed like the parameters, so a parallelized model's AdamW resumes exactly
(``optimizer.state_dict()`` on one rank holds only that rank's shards, which ``torch.save`` on rank 0 loses).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from cpshard.parallel.checkpoint import CheckpointError, _on_rank_0, load_checkpoint, save_checkpoint

#: the files beside the tensors: the param groups (hyperparameters, the same on every rank), and each
#: tensor's dtype and shape (``null`` for a DTensor, shaped and placed like its parameter)
GROUPS = "param_groups.pt"
TENSORS = "optimizer_tensors.json"


def _torch_optimizer(optimizer):
    """The torch optimizer inside a wrapper (accelerate's ``AcceleratedOptimizer``)."""
    return getattr(optimizer, "optimizer", optimizer)


def _ordered_names(optimizer, model) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` in ``state_dict``'s order (its state is keyed by this position)."""
    names = {id(param): name for name, param in model.named_parameters()}
    ordered = [param for group in _torch_optimizer(optimizer).param_groups for param in group["params"]]
    return [(names[id(param)], param) for param in ordered]


def _flat_state(optimizer, model) -> dict[str, torch.Tensor]:
    """``{"<parameter name>/<state key>": tensor}`` of every parameter's state."""
    flat = {}
    for name, param in _ordered_names(optimizer, model):
        for key, value in _torch_optimizer(optimizer).state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"optimizer state {key!r} of {name} is a {type(value).__name__}, not a tensor: cpshard "
                    "checkpoints an optimizer's tensors only"
                )
            flat[f"{name}/{key}"] = value
    return flat


def save_optimizer_state(optimizer, model, path: str | os.PathLike) -> None:
    """Write ``optimizer``'s state (of ``model``'s parameters) to the folder ``path``; every rank calls it."""
    path = Path(path)
    flat = _flat_state(optimizer, model)
    save_checkpoint(flat, path)
    tensors = {
        key: [str(value.dtype), None if isinstance(value, DTensor) else list(value.shape)]
        for key, value in flat.items()
    }
    groups = _torch_optimizer(optimizer).state_dict()["param_groups"]

    def write() -> None:
        (path / TENSORS).write_text(json.dumps(tensors, indent=1))
        torch.save(groups, path / GROUPS)

    _on_rank_0(write, "save_optimizer_state")  # an error there is raised on every rank, none left waiting


def load_optimizer_state(optimizer, model, path: str | os.PathLike) -> None:
    """Load what :func:`save_optimizer_state` wrote into ``optimizer`` (built over ``model``'s parameters,
    placed as they are now); every rank calls it."""
    path = Path(path)
    ordered = _ordered_names(optimizer, model)
    params, index = dict(ordered), {name: i for i, (name, _) in enumerate(ordered)}
    targets = {}
    for key, (dtype, shape) in json.loads((path / TENSORS).read_text()).items():
        name = key.rpartition("/")[0]
        if name not in params:
            raise CheckpointError(
                f"{path} holds the optimizer state of {name}, which the model does not have"
            )
        dtype = getattr(torch, dtype.removeprefix("torch."))
        like = params[name].detach()
        targets[key] = (
            torch.empty_like(like, dtype=dtype) if shape is None else torch.zeros(shape, dtype=dtype)
        )
    state = {}
    for key, value in load_checkpoint(path, targets).items():
        name, _, field = key.rpartition("/")
        state.setdefault(index[name], {})[field] = value
    groups = torch.load(path / GROUPS, weights_only=True)
    _torch_optimizer(optimizer).load_state_dict({"state": state, "param_groups": groups})
