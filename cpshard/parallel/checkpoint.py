"""Checkpoints of parameter dicts: distributed (torch DCP), and gathered into a transformers folder.

DCP stores each tensor with its global shape and every rank's piece, so a checkpoint saved under one
mesh loads under any other, and on one process with no process group at all. Keys are the
``params_of`` names. DCP keeps no checksum, so a save adds a manifest (``cpshard.json``: each file's
size and sha256, the model's type) and a load verifies it first: a damaged, truncated or missing file,
or a checkpoint of another model, is an error on every rank, never wrong weights. A save is written
beside its path and renamed into place at the end, so one cut short never leaves a folder that loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

from cpshard.parallel.fsdp import block_shape, full_tensors
from cpshard.parallel.params import check_params_mapping

MANIFEST = "cpshard.json"
_FORMAT = "cpshard checkpoint 1"
_HASH_BLOCK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: damaged, incomplete, or of another model."""


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


def _share(items: list) -> list:
    """This rank's share of ``items`` (all of them on one process)."""
    return items if _no_dist() else items[dist.get_rank() :: dist.get_world_size()]


def _gathered(items: list) -> list:
    """Every rank's ``items``, joined (in rank order)."""
    if _no_dist():
        return items
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, items)
    return [item for items_of_rank in every for item in items_of_rank]


def _on_rank_0(action, what: str) -> None:
    """``action()`` on rank 0 (or the one process); an error there is raised on every rank."""
    error = None
    if _no_dist() or dist.get_rank() == 0:
        try:
            action()
        except Exception as caught:  # noqa: BLE001 - told to every rank below
            error = caught
    if not _no_dist():
        told = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(told, src=0)
        if told[0] is not None and error is None:
            raise RuntimeError(f"{what} failed on rank 0: {told[0]}")
    if error is not None:
        raise error


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as stream:
        while block := stream.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _model_identity(model) -> dict | None:
    return None if model is None else {"model_type": model.config.model_type, "class": type(model).__name__}


def _describe(identity: dict | None) -> str:
    return (
        "an unknown model" if identity is None else f"a {identity['model_type']} model ({identity['class']})"
    )


def _publish(partial: Path, path: Path, manifest: dict) -> None:
    """The manifest written last, then the finished folder renamed into place (replacing a checkpoint)."""
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if path.exists():
        if any(path.iterdir()) and not (path / MANIFEST).exists() and not (path / ".metadata").exists():
            raise CheckpointError(f"{os.fspath(path)!r} exists and is not a checkpoint: not replaced")
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        partial.rename(path)
        shutil.rmtree(old)
    else:
        partial.rename(path)


def save_checkpoint(params: dict, path: str | os.PathLike, *, model=None) -> None:
    """Write ``params`` (plain tensors and DTensors) to the folder ``path``; every rank of the default group
    calls it. ``model`` (optional) records its type, which ``load_checkpoint`` then checks."""
    check_params_mapping(params, "save_checkpoint")
    path = Path(path)
    partial = _partial(path)
    _on_rank_0(
        lambda: shutil.rmtree(partial, ignore_errors=True), "save_checkpoint"
    )  # what a save cut short left
    with _quiet_single_process():
        dcp.save(
            {name: value.detach() for name, value in params.items()},
            checkpoint_id=partial,
            no_dist=_no_dist(),
        )
    files = sorted(file.name for file in partial.iterdir())
    digests = _gathered(
        [(name, (partial / name).stat().st_size, _sha256(partial / name)) for name in _share(files)]
    )
    manifest = {
        "format": _FORMAT,
        "model": _model_identity(model),
        "files": {name: {"bytes": size, "sha256": sha} for name, size, sha in sorted(digests)},
    }
    _on_rank_0(lambda: _publish(partial, path, manifest), "save_checkpoint")


def _read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """The manifest, or why there is none."""
    if not path.is_dir():
        partial = _partial(path)
        left = f"; a save that did not finish left {os.fspath(partial)!r}" if partial.exists() else ""
        return None, f"there is no checkpoint folder {os.fspath(path)!r}{left}"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None, (
            f"{os.fspath(path)!r} has no {MANIFEST}: it was not written by cpshard.save_checkpoint, "
            "or its save did not finish, so its files cannot be verified"
        )
    except (OSError, ValueError) as error:
        return None, f"its {MANIFEST} cannot be read ({error})"
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        return None, f"its {MANIFEST} is not a {_FORMAT!r} manifest"
    return manifest, None


def _file_problem(path: Path, name: str, saved: dict) -> str | None:
    """What is wrong with one file of the checkpoint, if anything."""
    file = path / name
    if not file.is_file():
        return f"file {name} is missing"
    size = file.stat().st_size
    if size != saved["bytes"]:
        cut = "truncated" if size < saved["bytes"] else "longer than saved"
        return f"file {name} is {cut}: {size} bytes, {saved['bytes']} when saved"
    if _sha256(file) != saved["sha256"]:
        return f"file {name} is damaged: its sha256 differs from the one saved"
    return None


def _held_in(path: Path, name: str) -> str:
    """The tensors ``name`` holds pieces of, when the checkpoint's metadata still says so."""
    try:
        storage = dcp.FileSystemReader(path).read_metadata().storage_data
    except Exception:  # noqa: BLE001 - the metadata may be what is damaged
        return ""
    held = sorted({index.fqn for index, info in storage.items() if info.relative_path == name})
    if not held:
        return ""
    more = f" and {len(held) - 4} more" if len(held) > 4 else ""
    return f" (it holds {', '.join(held[:4])}{more})"


def _verified(path: Path) -> dict:
    """The manifest of a checkpoint whose every file has its saved size and checksum; otherwise a
    CheckpointError on every rank alike, each rank having checked its share of the files."""
    manifest, problem = _read_manifest(path)
    problems = [problem] if problem else []
    if manifest is not None:
        for name in _share(sorted(manifest["files"])):
            if (problem := _file_problem(path, name, manifest["files"][name])) is not None:
                problems.append(problem + _held_in(path, name))
    problems = sorted(set(_gathered(problems)))
    if problems:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} cannot be loaded: "
            + "; ".join(problems)
            + "; save it again or load an intact copy"
        )
    return manifest


def _names(names: list[str]) -> str:
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return ", ".join(names[:4]) + more


def _check_against(path: Path, manifest: dict, params: dict, model, strict: bool) -> None:
    """The checkpoint is of this model: its type, and every key with its global shape and dtype (raised on
    every rank alike: the manifest, the metadata and the targets' global shapes are the same on each)."""
    where = f"checkpoint {os.fspath(path)!r}"
    saved_model, target_model = manifest["model"], _model_identity(model)
    if saved_model is not None and target_model is not None and saved_model != target_model:
        raise CheckpointError(
            f"{where} was saved from {_describe(saved_model)}, the target is {_describe(target_model)}"
        )
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = [name for name in params if name not in stored]
    extra = [name for name in stored if name not in params] if strict else []
    if missing or extra:
        lacks = [f"it has no {_names(missing)}"] if missing else []
        holds = [f"it holds {len(extra)} tensors the target has not ({_names(extra)})"] if extra else []
        hint = "; pass strict=False to load a part of it" if extra and not missing else ""
        raise CheckpointError(
            f"{where}, saved from {_describe(saved_model)}, does not fit the target: "
            + "; ".join(lacks + holds)
            + hint
        )
    for name, value in params.items():
        meta = stored[name]
        shape, dtype = (
            tuple(getattr(meta, "size", ())),
            getattr(getattr(meta, "properties", None), "dtype", None),
        )
        if shape != tuple(value.shape) or dtype != value.dtype:
            raise CheckpointError(
                f"{where} holds {name} as {dtype} {list(shape)}, the target is {value.dtype} "
                f"{list(value.shape)}; load into a target like the saved tensor, then convert"
            )


def load_checkpoint(path: str | os.PathLike, params: dict, *, model=None, strict: bool = True) -> dict:
    """New tensors like ``params`` (type, shape, dtype, mesh, placements) holding the saved values, bitwise.

    The checkpoint's files are verified against their checksums first. ``params`` itself is left as it
    was. ``strict=False`` allows the checkpoint to hold keys ``params`` does not ask for; ``model``
    (optional) must be of the type the checkpoint was saved from."""
    check_params_mapping(params, "load_checkpoint")
    path = Path(path)
    manifest = _verified(path)
    _check_against(path, manifest, params, model, strict)
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
    _on_rank_0(lambda: model.save_pretrained(folder, state_dict={**buffers, **tensors}), "save_pretrained")


def _saved_weights(model, folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a ``save_pretrained`` folder by ``model``'s parameter names: the model's class loads
    them, undoing whatever renaming transformers does to the names it saves."""
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json: not a folder save_pretrained wrote")
    loaded, info = type(model).from_pretrained(
        folder, config=model.config, dtype=model.dtype, output_loading_info=True
    )
    if info["missing_keys"]:
        raise CheckpointError(f"{folder} lacks the weights of {_names(sorted(info['missing_keys']))}")
    return {name: param.detach() for name, param in loaded.named_parameters(remove_duplicate=False)}


def load_whole_weights(model, folder: str | os.PathLike) -> None:
    """Put the whole weights of a ``save_pretrained`` folder into ``model``'s parameters, each DTensor
    taking its own shard as ``cpshard.parallelize`` cut it (no communication); every parameter must be
    there (under one of its tied names), or every rank raises."""
    weights = _saved_weights(model, Path(folder))
    placed = set()
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in placed or name not in weights:
                continue
            whole = weights[name].to(param.dtype)
            if isinstance(param, DTensor):
                piece = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(piece.to_local())
            else:
                param.copy_(whole)
            placed.add(id(param))
    missing = [name for name, param in model.named_parameters() if id(param) not in placed]
    if missing:
        raise CheckpointError(f"{folder} lacks the weights of {_names(missing)}")
