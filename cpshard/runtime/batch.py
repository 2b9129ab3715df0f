"""The batch: checks, a fingerprint to compare across ranks, and padding to a multiple of cp.

Labels are shifted over the whole sequence before it is cut, so the label of each rank's last
token comes from the next rank's first; padding sits at the end of every row, after all real
tokens, where a causal model never looks, so no mask of our own is ever added.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpshard.comm.consensus import differing_ranks, gather_checked
from cpshard.comm.record import serving
from cpshard.loss.cross_entropy import IGNORE_INDEX
from cpshard.parallel.mesh import SAME_BATCH_AXES
from cpshard.spec.sequence import padded_length_for, positions

INPUT_KEYS = ("input_ids", "inputs_embeds")
TOKEN_KEYS = ("labels", "shift_labels", "attention_mask", "position_ids")
#: inputs beside the tokens that a layout may take (its ``whole_inputs``), whole on every rank and never
#: padded: BLT's ``patch_lengths`` ``[B, P]``, one integer per patch (precomputed patching)
WHOLE_KEYS = ("patch_lengths",)
#: the label-token count of the whole optimizer step (gradient accumulation): a 0-dim integer
COUNT_KEY = "num_items_in_batch"
BATCH_KEYS = INPUT_KEYS + TOKEN_KEYS + WHOLE_KEYS + (COUNT_KEY,)
_FINGERPRINT_DIMS = 3
#: per key: present, rank, the first dims' sizes and two weighted sums of the values
_FINGERPRINT_ENTRIES = _FINGERPRINT_DIMS + 4
#: a fingerprint's key count where the rank's checks of the call's model and params failed
_CHECKS_FAILED = float("-inf")


def _marked_invalid(count: float) -> float:
    """A fingerprint's key count marked as a batch that is not valid (below 0, never :data:`_CHECKS_FAILED`),
    and a marked count back: its own inverse."""
    return -1.0 - count


class BatchError(ValueError):
    """A batch that cpshard cannot run, with what to change."""


def fingerprint(batch) -> torch.Tensor:
    """A small float64 vector that differs when keys, shapes or values differ; safe on any input."""
    entries = []
    keys = sorted(batch) if isinstance(batch, Mapping) else []
    entries.append(float(len(keys)))
    for key in BATCH_KEYS:
        value = batch.get(key) if isinstance(batch, Mapping) else None
        if isinstance(value, int):
            value = torch.tensor(value)
        if not isinstance(value, torch.Tensor):
            entries.extend([0.0] * _FINGERPRINT_ENTRIES)
            continue
        shape = list(value.shape[:_FINGERPRINT_DIMS]) + [0] * (_FINGERPRINT_DIMS - value.dim())
        flat = value.detach().reshape(-1).to(torch.float64)
        index = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device)
        # two bounded weightings: together they tell apart values swapped between any two positions
        sums = [float((flat * weights).sum()) for weights in (index % 997 + 1, index // 997 + 1)]
        # present (1), or present and requiring a gradient (2): its gradient's all-reduce runs where it does
        entries.extend([1.0 + value.requires_grad, float(value.dim()), *map(float, shape), *sums])
    return torch.tensor(entries, dtype=torch.float64)


def _require_2d(batch: Mapping, key: str, shape: tuple[int, int]) -> None:
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        raise BatchError(f"batch[{key!r}] must be a tensor, got {type(value).__name__}")
    if value.dim() != 2:
        hint = (
            " (a 2-D padding mask: 1 for real tokens, 0 for padding; cpshard builds the 4-D mask)"
            if key == "attention_mask"
            else ""
        )
        raise BatchError(
            f"batch[{key!r}] must be 2-D [B, L] = {list(shape)}, got shape {list(value.shape)}{hint}"
        )
    batch_ok = value.shape[0] == shape[0] or (key == "position_ids" and value.shape[0] == 1)
    if not batch_ok or value.shape[1] != shape[1]:
        raise BatchError(
            f"batch[{key!r}] has shape {list(value.shape)} but the inputs are [B, L] = {list(shape)}; "
            "every per-token field must match"
        )


def _check_labels(batch: Mapping, vocab_size: int | None) -> None:
    """Labels are integer token ids below the vocabulary size, or IGNORE_INDEX: else the loss would index
    out of range on the rank that holds the bad token only, while the others wait in a collective."""
    for key in ("labels", "shift_labels"):
        labels = batch.get(key)
        if labels is None:
            continue
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise BatchError(f"batch[{key!r}] must hold integer token ids, got dtype {labels.dtype}")
        bad = (labels != IGNORE_INDEX) & (
            (labels < 0) | (labels >= (vocab_size or torch.iinfo(labels.dtype).max))
        )
        if bad.any():
            where = tuple(bad.nonzero()[0].tolist())
            bound = f"below the vocabulary size {vocab_size}" if vocab_size else "non-negative"
            raise BatchError(
                f"batch[{key!r}] holds {int(labels[where])} at {list(where)}: labels must be token ids "
                f"{bound}, or {IGNORE_INDEX} for tokens without a loss"
            )


def _check_whole(batch: Mapping, rows: int, taken: tuple[str, ...]) -> None:
    """Each of :data:`WHOLE_KEYS` given: one the model takes (``taken``: its layout's ``whole_inputs``), a
    2-D integer tensor of one row per sequence; else a model would get an input it reads nowhere."""
    for key in WHOLE_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        if key not in taken:
            raise BatchError(
                f"batch[{key!r}]: this model's layout takes no {key} (inputs it takes beside the tokens: "
                f"{', '.join(taken) or 'none'}); leave it out of the batch"
            )
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        integral = (
            isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool
        )
        if not integral or value.dim() != 2 or value.shape[0] != rows:
            raise BatchError(
                f"batch[{key!r}] must be a 2-D integer tensor of {rows} rows (one per sequence), got {shape}"
            )


def validate(batch, vocab_size: int | None = None, whole: tuple[str, ...] = ()) -> tuple[int, int]:
    """Raise a :class:`BatchError` naming what is wrong (labels against ``vocab_size`` where given, inputs
    beside the tokens other than ``whole``); return ``(B, L)``."""
    if not isinstance(batch, Mapping):
        raise BatchError(f"the batch must be a dict of tensors, got {type(batch).__name__}")
    unknown = sorted(set(batch) - set(BATCH_KEYS), key=str)
    if unknown:
        raise BatchError(f"unknown batch keys {unknown}; allowed: {', '.join(BATCH_KEYS)}")
    given = [key for key in INPUT_KEYS if batch.get(key) is not None]
    if len(given) != 1:
        raise BatchError(
            f"the batch needs exactly one of input_ids or inputs_embeds, got {given or 'neither'}"
        )
    inputs = batch[given[0]]
    want_dim = 2 if given[0] == "input_ids" else 3
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != want_dim:
        shape = list(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise BatchError(f"batch[{given[0]!r}] must be a {want_dim}-D tensor, got {shape}")
    if given[0] == "input_ids" and inputs.is_floating_point():
        raise BatchError("batch['input_ids'] must hold integer token ids; pass embeddings as inputs_embeds")
    shape = (inputs.shape[0], inputs.shape[1])
    if shape[0] < 1 or shape[1] < 1:
        raise BatchError(f"the batch must have at least one row and one token, got [B, L] = {list(shape)}")
    for key in TOKEN_KEYS:
        if batch.get(key) is not None:
            _require_2d(batch, key, shape)
    _require_count(batch.get(COUNT_KEY))
    _check_labels(batch, vocab_size)
    _check_whole(batch, shape[0], whole)
    return shape


def _require_count(count) -> None:
    """``num_items_in_batch``: absent, or a positive int / 0-dim integer tensor."""
    if count is None:
        return
    integral = isinstance(count, int) or (
        isinstance(count, torch.Tensor) and count.dim() == 0 and not count.is_floating_point()
    )
    if not integral or int(count) < 1:
        raise BatchError(
            f"batch[{COUNT_KEY!r}] must be a positive integer (an int or a 0-dim integer tensor), got "
            f"{count!r}: the label tokens of every micro-batch, from cpshard.count_label_tokens"
        )


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token labels over the whole row: position i holds labels[i + 1], the last ignored."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def labels_read_as_shifted(batch: dict) -> dict:
    """The batch of a model whose own loss reads ``labels`` as already shifted (BART's causal LMs): its
    labels become ``shift_labels``, so cp's loss is the model's."""
    if batch.get("labels") is None or batch.get("shift_labels") is not None:
        return batch
    return {**{k: v for k, v in batch.items() if k != "labels"}, "shift_labels": batch["labels"]}


def continued_positions(position_ids: torch.Tensor, extra: int) -> torch.Tensor:
    """``extra`` more positions per row, continuing the last document (so no new one starts)."""
    steps = torch.arange(1, extra + 1, device=position_ids.device, dtype=position_ids.dtype)
    return torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1)


def _pad_tokens(x: torch.Tensor, extra: int, value) -> torch.Tensor:
    """Pad dim 1 (tokens) at the end."""
    pad = [0, 0] * (x.dim() - 2) + [0, extra]
    return torch.nn.functional.pad(x, pad, value=value)


@dataclass(frozen=True)
class PaddedBatch:
    """The batch laid out for cp: model inputs and shifted labels padded to ``padded_length``."""

    model_inputs: dict
    shift_labels: torch.Tensor | None
    length: int
    padded_length: int
    #: ``num_items_in_batch`` when the batch gives it (the loss divides by it), else None
    num_items: int | torch.Tensor | None = None


def packed_documents(batch: Mapping) -> bool:
    """Whether some row holds several documents: its ``position_ids`` do not count up by one from one
    real token to the next (each document restarts them; padding, where ``attention_mask`` marks it, may
    hold any position). Such rows' causal work is per document (batch already validated)."""
    position_ids = batch.get("position_ids")
    if position_ids is None:
        return False
    restarts = position_ids.diff(dim=1) != 1
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        real = mask.bool()
        restarts &= real[:, 1:] & real[:, :-1]
    return bool(restarts.any())


#: what packing collators (TRL's padding-free one, transformers' DataCollatorWithFlattening) add beside
#: ``position_ids`` for varlen kernels: the same document boundaries, as flash attention takes them
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def without_varlen_keys(batch: Mapping) -> dict:
    """``batch`` without its :data:`VARLEN_KEYS`, once they are checked to mark the documents its one row's
    ``position_ids`` restart (cpshard reads the documents from those): other boundaries are a BatchError."""
    given = [key for key in VARLEN_KEYS if key in batch]
    if not given:
        return dict(batch)
    position_ids = batch.get("position_ids")
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise BatchError(
            f"batch keys {given} mark the documents of one packed row; cpshard reads them from its "
            "position_ids, which the batch must give as [1, L]"
        )
    row = position_ids[0]
    cu_seq_lens = torch.cat([(row == 0).nonzero().flatten(), torch.tensor([row.numel()], device=row.device)])
    lengths = cu_seq_lens.diff()
    expected = {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": lengths.max(),
        "max_length_k": lengths.max(),
        "seq_idx": torch.repeat_interleave(torch.arange(len(lengths), device=row.device), lengths)[None],
    }
    for key in given:
        value = torch.as_tensor(batch[key], device=row.device)
        if value.shape != expected[key].shape or not torch.equal(value.long(), expected[key].long()):
            raise BatchError(
                f"batch[{key!r}] does not mark the documents that position_ids restart (at 0); cpshard "
                "reads the documents from position_ids: give the two alike, or leave the varlen keys out"
            )
    return {key: value for key, value in batch.items() if key not in VARLEN_KEYS}


def pad_batch(batch: Mapping, cp: int, pad_token_id: int | None, order: str = "contiguous") -> PaddedBatch:
    """Pad every per-token field to a length that splits into ``order``'s equal chunks over ``cp`` ranks
    and shift the labels (batch already validated)."""
    length = next(batch[key] for key in INPUT_KEYS if batch.get(key) is not None).shape[1]
    extra = padded_length_for(length, cp, order) - length
    inputs = {}
    if batch.get("input_ids") is not None:
        inputs["input_ids"] = _pad_tokens(batch["input_ids"], extra, pad_token_id or 0)
    else:
        inputs["inputs_embeds"] = _pad_tokens(batch["inputs_embeds"], extra, 0.0)
    if batch.get("attention_mask") is not None:
        inputs["attention_mask"] = _pad_tokens(batch["attention_mask"], extra, 0)
    if batch.get("position_ids") is not None:
        inputs["position_ids"] = continued_positions(batch["position_ids"], extra)
    inputs.update({key: batch[key] for key in WHOLE_KEYS if batch.get(key) is not None})
    labels = batch.get("shift_labels")
    if labels is None and batch.get("labels") is not None:
        labels = shifted_labels(batch["labels"])
    if labels is not None:
        labels = _pad_tokens(labels, extra, IGNORE_INDEX)
    return PaddedBatch(inputs, labels, length, length + extra, batch.get(COUNT_KEY))


def _differs_message(differing: list[int], first: int, rows: dict[int, torch.Tensor]) -> str:
    """``rows``: the fingerprints of ``first`` and ``differing[0]``, whose differences the message names."""
    what = fingerprint_differences(rows, first, differing[0])
    return (
        f"the batch differs across the cp group: ranks {differing} hold other keys, shapes or values than "
        f"rank {first} ({what}). Every rank of a cp group takes the same whole sequences (cpshard cuts them "
        "itself); give different batches to different dp ranks only"
    )


def _described(entries: torch.Tensor) -> str:
    """One key's fingerprint entries as what the message says of it: absent (or not a tensor), or its shape
    (its first dims: :data:`_FINGERPRINT_DIMS`)."""
    if entries[0] == 0:
        return "absent (or not a tensor)"
    dims = int(entries[1])
    shape = [str(int(size)) for size in entries[2 : 2 + min(dims, _FINGERPRINT_DIMS)]]
    return f"shape [{', '.join(shape + ['...'] * (dims > _FINGERPRINT_DIMS))}]"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Fingerprint entries alike bit for bit (a NaN is its own equal), as :func:`differing_ranks` compares."""
    return torch.equal(a.view(torch.int64), b.view(torch.int64))


def fingerprint_differences(rows: dict[int, torch.Tensor], first: int, other: int) -> str:
    """What differs between two ranks' batches, as their fingerprints (:func:`fingerprint`, as
    :func:`check_batch` gathers them) tell it: each key that one lacks or holds in another shape, each rank's
    ("input_ids: shape [2, 37] on rank 0, shape [2, 36] on rank 1"), a gradient wanted on one rank only, and
    the keys whose values differ."""
    mine, theirs = rows[first].to(torch.float64), rows[other].to(torch.float64)
    failed = [rank for rank, row in ((first, mine), (other, theirs)) if row[0] == _CHECKS_FAILED]
    if failed:
        return f"ranks {failed} failed their checks of the call's model and params"
    counts = [int(row[0] if row[0] >= 0 else _marked_invalid(row[0])) for row in (mine, theirs)]
    said = (
        [f"keys: {counts[0]} on rank {first}, {counts[1]} on rank {other}"] if counts[0] != counts[1] else []
    )
    values = []
    for index, key in enumerate(BATCH_KEYS):
        part = slice(1 + index * _FINGERPRINT_ENTRIES, 1 + (index + 1) * _FINGERPRINT_ENTRIES)
        a, b = mine[part], theirs[part]
        if (a[0] == 0) != (b[0] == 0) or not _same(a[1:-2], b[1:-2]):
            said.append(f"{key}: {_described(a)} on rank {first}, {_described(b)} on rank {other}")
            continue
        if a[0] != b[0]:
            said.append(f"{key}: requires a gradient on rank {first if a[0] > b[0] else other} only")
        if not _same(a[-2:], b[-2:]):
            values.append(key)
    if values:
        said.append(f"other values of {', '.join(values)}")
    return "; ".join(said) or "other keys"


def _dp_groups(mesh) -> list[list[int]]:
    """The global ranks of each dp group: those that differ only along cp and tp, in mesh order."""
    names = mesh.mesh_dim_names or ()
    same = [i for i, name in enumerate(names) if name in SAME_BATCH_AXES]
    other = [i for i in range(len(names)) if i not in same]
    width = math.prod(mesh.mesh.shape[i] for i in same)
    return mesh.mesh.permute(*other, *same).reshape(-1, width).tolist()


def failed_elsewhere(failing: list[int]) -> ValueError:
    """What the other ranks raise where ``failing`` ranks' checks of the call's model and params failed (a
    collective carried the failure; each failing rank raises its own error)."""
    return ValueError(
        f"ranks {failing} failed cp_forward's checks of the model and its params (each says why: a "
        "params dict of another model, or missing entries); every rank stops, so none waits for them"
    )


def check_batch(
    batch,
    mesh,
    vocab_size: int | None = None,
    packed_refusal: str | None = None,
    whole: tuple[str, ...] = (),
    failed: Exception | None = None,
) -> tuple[int, int]:
    """:func:`validate` the batch (the model taking the inputs ``whole`` beside its tokens) and check it is
    the same on every rank of each dp group; return ``(B, L)``. A batch of packed documents is refused with
    ``packed_refusal`` where one is given. ``failed``: this rank's own checks of the call's model and params
    raised it; the all-gather carries the failure too, and every rank raises (this one its own error).

    Every rank of the mesh raises, or none does: one all-gather over the whole mesh, before any other
    collective, carries each rank's fingerprint and whether its batch is valid. A check within the cp
    group alone would let the other dp groups go on into the loss and gradient all-reduces, where they
    would wait for the failed ranks until the process group's timeout."""
    from cpshard.parallel.mesh import group_over

    try:
        shape, error = validate(batch, vocab_size, whole), None
        if packed_refusal is not None and packed_documents(batch):
            raise BatchError(packed_refusal)
    except BatchError as raised:
        shape, error = None, raised
    group = group_over(mesh, tuple(mesh.mesh_dim_names or ()))
    if group is None:  # one rank
        if failed is not None or error is not None:
            raise failed or error
        return shape
    row = fingerprint(batch)
    if error is not None:  # a key count below 0 (not -inf: that is a failed rank's), so no byte is added
        row[0] = _marked_invalid(row[0])
    with serving("other"):
        every, failing = gather_checked(row, group, "batch fingerprint", failed, _CHECKS_FAILED)
    ranks = dist.get_process_group_ranks(group)
    index = {rank: i for i, rank in enumerate(ranks)}
    if failing:
        raise failed_elsewhere(failing)
    differing = {
        tuple(m): d for m in _dp_groups(mesh) if (d := differing_ranks(every[[index[r] for r in m]], m))
    }
    if differing:  # this rank's own dp group first, else the first one
        members = next((m for m in differing if dist.get_rank() in m), next(iter(differing)))
        rows = {rank: every[index[rank]] for rank in (members[0], differing[members][0])}
        message = _differs_message(differing[members], members[0], rows)
        if dist.get_rank() not in members:
            message += (
                f" (in the dp group of ranks {list(members)}; every rank stops, so none waits in a "
                "collective)"
            )
        raise BatchError(message)
    if error is not None:
        raise error
    invalid = [rank for rank in ranks if every[index[rank], 0] < 0]
    if invalid:
        raise BatchError(
            f"ranks {invalid} hold a batch that is not valid (their own errors say why); "
            "every rank stops, so that none waits in a collective"
        )
    return shape


def local_token_mask(padded: PaddedBatch, order: str, cp: int, rank: int) -> torch.Tensor:
    """1 for this rank's real tokens, 0 for padding (the batch's where it has an attention mask, and cp's),
    in the order the rank's layers hold them: ``[B, L / cp]``."""
    first = next(iter(padded.model_inputs.values()))
    mask = padded.model_inputs.get("attention_mask")
    if mask is None:
        real = torch.arange(padded.padded_length, device=first.device) < padded.length
        mask = real.expand(first.shape[0], -1)
    held = positions(order, padded.padded_length, cp, rank).to(mask.device)
    return mask.index_select(1, held).to(torch.float32)
