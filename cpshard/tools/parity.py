"""Parity: a cp run against one process on the same weights and batch, per tensor group.

Used by the demo, by ``cpshard check`` and by the tests. The reference runs the plain model
on this rank alone (no collectives); the cp run is ``value_and_grad(cp_forward)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode

from cpshard.comm.record import recording
from cpshard.layouts.structure import text_config
from cpshard.runtime.difference import one_process
from cpshard.runtime.forward import params_of
from cpshard.runtime.grad import value_and_grad

#: fp32: a row passes when its largest difference is at most this times its reference's scale
RTOL = 1e-5


def tensor_group(name: str) -> str:
    """The row a parameter is reported under: a decoder layer's sub-block, or its owning module."""
    parts = name.split(".")
    if "layers" in parts:
        return ".".join(parts[: parts.index("layers") + 3])
    return ".".join(parts[:-1]) or name


def reference(model, params: dict, batch: dict):
    """Loss, logits and gradients of the plain model on this process alone. The model holds ``params``
    through the backward too: one that runs a backward of its own inside autograd's (Reformer's reversible
    layers recompute each layer and call ``backward()`` on it) leaves those gradients in their ``.grad``,
    which count with autograd's."""
    leaves = {name: value.detach().requires_grad_(True) for name, value in params.items()}
    inputs = {key: value for key, value in batch.items() if key != "shift_labels"}
    with _reparametrize_module(model, leaves, tie_weights=True, strict=False):
        output = model(**inputs, use_cache=False)
        loss = output.loss
        if "shift_labels" in batch:  # transformers takes shift_labels in its loss only, not in forward
            loss = model.loss_function(
                output.logits, None, text_config(model).vocab_size, shift_labels=batch["shift_labels"]
            )
            if (
                getattr(output, "aux_loss", None) is not None
            ):  # the MoE router's load-balancing loss, as with labels
                loss = loss + text_config(model).router_aux_loss_coef * output.aux_loss
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    grads = {n: _with_own_backward(g, p) for (n, p), g in zip(leaves.items(), grads)}
    return loss.detach(), output.logits.detach(), grads


def _with_own_backward(grad: torch.Tensor | None, leaf: torch.Tensor) -> torch.Tensor:
    """autograd's gradient of ``leaf`` plus what a backward inside the model left in its ``.grad``."""
    own = leaf.grad
    if grad is None:
        return torch.zeros_like(leaf) if own is None else own
    return grad if own is None else grad + own


@dataclass(frozen=True)
class Parity:
    """Largest absolute differences per row (``loss``, ``logits``, then gradient groups), and the scale
    of the reference values in each row (so a tiny difference of tiny values is not mistaken for a pass)."""

    diffs: dict[str, float]
    scales: dict[str, float]
    comm_bytes: int

    @property
    def worst(self) -> float:
        return max(self.diffs.values())

    def passes(self, rtol: float = RTOL) -> dict[str, bool]:
        """Pass or fail per row: the largest difference against ``rtol`` times the reference's scale."""
        return {row: diff <= rtol * self.scales[row] for row, diff in self.diffs.items()}


def failing_rows(parities: list[Parity], rtol: float = RTOL) -> list[str]:
    """The rows that fail on any rank, in row order."""
    verdicts = [parity.passes(rtol) for parity in parities]
    return [row for row in parities[0].diffs if not all(v[row] for v in verdicts)]


def format_rows(
    parities: list[Parity], rtol: float = RTOL, rounding: tuple[str, ...] = (), dtype: str = "fp32"
) -> list[str]:
    """A header and one line per row: the worst difference over the ranks, the scale, pass/FAIL (``pass
    (fp32 rounding)``, or another ``dtype``'s, for the failing ``rounding`` rows, which a run in a wider
    type showed within that rounding)."""
    rows, failing = parities[0].diffs, set(failing_rows(parities, rtol))
    width = max(map(len, rows))
    lines = [f"  {'row':<{width}}  {'max |diff|':>10}  {'scale':>9}"]
    for row in rows:
        diff, scale = max(p.diffs[row] for p in parities), parities[0].scales[row]
        verdict = (f"pass ({dtype} rounding)" if row in rounding else "FAIL") if row in failing else "pass"
        lines.append(f"  {row:<{width}}  {diff:10.2e}  {scale:9.2e}  {verdict}")
    return lines


def _update(table: dict, key: str, value: float) -> None:
    table[key] = max(table.get(key, 0.0), value)


def _row_differences(loss, logits, grads: dict, ref_loss, ref_logits, ref_grads: dict) -> tuple[dict, dict]:
    """Per row (``loss``, ``logits`` where there are any, then gradient groups): the largest difference of a
    run from a reference, and the reference's largest value (the row's scale)."""
    diffs = {"loss": (loss - ref_loss).abs().item()}
    scales = {"loss": ref_loss.abs().item()}
    if logits is not None:  # None under logits=False: the loss never holds them
        diffs["logits"] = (logits - ref_logits).abs().max().item()
        scales["logits"] = ref_logits.abs().max().item()
    for name, ref in ref_grads.items():
        group = "grad " + tensor_group(name)
        _update(diffs, group, (grads[name] - ref).abs().max().item())
        _update(scales, group, ref.abs().max().item())
    return diffs, scales


def _cp_run(params: dict, batch: dict, mesh, cp_forward):
    """Loss, logits (whole, or None) and gradients of ``cp_forward``."""
    output, grads = value_and_grad(cp_forward)(params, batch, mesh)
    logits = None if output.logits is None else output.logits.full_tensor().detach()
    return output.loss.detach(), logits, grads


def check_parity(model, batch: dict, mesh, cp_forward, params: dict | None = None) -> Parity:
    """Run ``cp_forward`` and the plain model on ``batch``; compare loss, logits and every gradient. What the
    plain model raises is raised as :class:`~cpshard.runtime.probe.OneProcessFailed`: the model's own.
    ``params`` placed on a mesh (``parallelize``'s DTensors) are refused: the plain model cannot run them."""
    params = params if params is not None else params_of(model)
    placed = [name for name, value in params.items() if isinstance(value, DTensor)]
    if placed:  # alike on every rank: each holds the same names placed
        raise ValueError(
            f"check_parity compares cp with the plain model run on this process alone, which parameters "
            f"placed on a mesh cannot run ({len(placed)} are DTensors, e.g. {placed[0]!r}: "
            "cpshard.parallelize's): check parity on the plain model and its params_of before parallelize "
            "(cp runs the same layout), or compare the parallel run's loss and gradients (their "
            "full_tensor()) with a plain twin model's"
        )
    with one_process():
        one = reference(model, params, batch)
    with recording() as log:
        cp = _cp_run(params, batch, mesh, cp_forward)
    return Parity(*_row_differences(*cp, *one), log.total_bytes)


class Widened(TorchFunctionMode):
    """Every ``narrow`` type a model's code asks for given as ``wide`` (Inkling2 and HY-V4 cast to fp32 in
    their norms, gates and hyper-connections: ``.float()``, ``dtype=torch.float32``), so that a run in the
    wider type stays in it throughout."""

    #: the Tensor methods that ask for a type by name
    CASTS = {torch.float32: torch.Tensor.float, torch.bfloat16: torch.Tensor.bfloat16}

    def __init__(self, narrow: torch.dtype = torch.float32, wide: torch.dtype = torch.float64):
        super().__init__()
        self.narrow, self.wide = narrow, wide

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is self.CASTS[self.narrow]:
            return args[0].to(self.wide)
        args = tuple(self.wide if value is self.narrow else value for value in args)
        kwargs = {key: self.wide if v is self.narrow else v for key, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


#: in float64, cp within this fraction of its fp32 distance from the exact result: the same arithmetic as one
#: process (a cp error keeps its size in float64; rounding shrinks to the float64 runs' floor, about 1e-7 of
#: scale as measured here: not every step of them is float64)
SAME_ARITHMETIC = 1e-2


@dataclass(frozen=True)
class Rounding:
    """Per row, against a float64 run of the same weights and batch (an fp32 run for a bf16 model): how far
    cp lies from it, how far one fp32 (bf16) process lies from it, and the float64 row's scale; where cp ran
    in float64 too (``arithmetic``), how far that run lies from it. fp32 rounding depends on the order of
    the additions, which cp changes; where one process itself is far from the exact result
    (gemma4_unified_text's gradients: 2.7e-5 of scale, cp 1.1e-5; qwen3_next's logits at cp 4 off its
    kernel's chunk grid: 2.3e-5, cp 1.3e-5), a gap of that size between the two says nothing about cp, while
    a cp error lies far outside. A row that cancels to a small part of its terms can leave cp more than
    twice as far as one process by rounding alone (HY-V4's hyper-connection head at cp 4: cp 5.8e-5 of
    scale, one process 2.3e-5); in float64 cp then lies within 1e-7 of the exact result, the same
    arithmetic (:data:`SAME_ARITHMETIC`)."""

    cp: dict[str, float]
    own: dict[str, float]
    scales: dict[str, float]
    arithmetic: dict[str, float] | None = None

    def beyond(self, rows: list[str], rtol: float = RTOL) -> list[str]:
        """Of ``rows``, those where cp lies farther from float64 than twice one process's own distance from
        it and than ``rtol`` of the row's scale, and, where cp ran in float64, is not the same arithmetic
        there: cp's own error, not rounding. A row whose distances are not numbers (NaN) is beyond: nothing
        vouches for it."""
        return [row for row in rows if not self.within_rounding(row, rtol) and not self.same_arithmetic(row)]

    def within_rounding(self, row: str, rtol: float = RTOL) -> bool:
        """Whether cp lies no farther from float64 than twice one process and ``rtol`` of the scale, every
        distance a number."""
        distances = (self.cp[row], self.own[row], self.scales[row])
        return not any(math.isnan(d) for d in distances) and self.cp[row] <= max(
            2 * self.own[row], rtol * self.scales[row]
        )

    def same_arithmetic(self, row: str) -> bool:
        """Whether cp's float64 run lies within :data:`SAME_ARITHMETIC` of its fp32 distance from float64."""
        return self.arithmetic is not None and self.arithmetic[row] <= SAME_ARITHMETIC * self.cp[row]

    def relative(self, row: str) -> tuple[float, ...]:
        """cp's and one process's distance from float64 in ``row`` (and cp's float64 run's, where it ran), as
        fractions of its scale."""
        scale = self.scales[row] or 1.0
        distances = (self.cp, self.own) + ((self.arithmetic,) if self.arithmetic is not None else ())
        return tuple(distance[row] / scale for distance in distances)


def widened(model, dtype: torch.dtype):
    """``model`` cast to ``dtype`` (in float64 its experts on the eager path: grouped_mm takes no float64)."""
    model = model.to(dtype)
    if dtype is torch.float64 and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model


def in_float64(model):
    """``model`` cast to float64 (:func:`widened`)."""
    return widened(model, torch.float64)


#: the type a second look runs in, per type of the model it looks at
WIDER = {torch.float32: torch.float64, torch.bfloat16: torch.float32}


def float64_distances(twin, own, params: dict, batch: dict, mesh, cp_forward, twin_forward=None) -> Rounding:
    """:class:`Rounding` of ``cp_forward`` and the plain model ``own`` (fp32, or bf16) on ``params`` and
    ``batch``; the exact run is ``twin``'s (a fresh model of ``own``'s config, cast here to float64, or to
    fp32 for a bf16 ``own`` (:data:`WIDER`), its own casts to ``own``'s type kept in the wider one by
    :class:`Widened`); ``twin_forward``, a cp forward over another fresh model cast by :func:`widened`
    to the same type, runs cp in that type too."""
    cp = _cp_run(params, batch, mesh, cp_forward)
    one = reference(own, params, batch)
    narrow = next(iter(params.values())).dtype
    wide = WIDER[narrow]
    wider_params = {name: value.to(wide) for name, value in params.items()}
    with Widened(narrow, wide):
        exact = reference(widened(twin, wide), wider_params, batch)
        cp64 = None if twin_forward is None else _cp_run(wider_params, batch, mesh, twin_forward)
    cp_distances, scales = _row_differences(*cp, *exact)
    if cp[1] is None:  # the plain model's logits are not compared where cp's loss never held them
        one = (one[0], None, one[2])
    arithmetic = None if cp64 is None else _row_differences(*cp64, *exact)[0]
    return Rounding(cp_distances, _row_differences(*one, *exact)[0], scales, arithmetic)


def beyond_own_rounding(twin, own, params: dict, batch: dict, mesh, cp_forward, rows: list[str]) -> list[str]:
    """Of the ``rows`` failing at 1e-5 of their scale (loss, logits or gradients), those beyond fp32 rounding
    (:meth:`Rounding.beyond`): cp within 1e-5 of the exact result, or no farther from it than twice one
    process, is exact by the tests' own measure."""
    if not rows:
        return rows
    return float64_distances(twin, own, params, batch, mesh, cp_forward).beyond(rows)
