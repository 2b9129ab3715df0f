"""Parity: a cp run against one process on the same weights and batch, per tensor group.

Used by the demo, by ``cpshard check`` and by the tests. The reference runs the plain model
on this rank alone (no collectives); the cp run is ``value_and_grad(cp_forward)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode

from cpshard.comm.record import recording
from cpshard.layouts.structure import text_config
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


def format_rows(parities: list[Parity], rtol: float = RTOL) -> list[str]:
    """A header and one line per row: the worst difference over the ranks, the scale, pass/FAIL."""
    rows, failing = parities[0].diffs, set(failing_rows(parities, rtol))
    width = max(map(len, rows))
    lines = [f"  {'row':<{width}}  {'max |diff|':>10}  {'scale':>9}"]
    for row in rows:
        diff, scale = max(p.diffs[row] for p in parities), parities[0].scales[row]
        lines.append(f"  {row:<{width}}  {diff:10.2e}  {scale:9.2e}  {'FAIL' if row in failing else 'pass'}")
    return lines


def _update(table: dict, key: str, value: float) -> None:
    table[key] = max(table.get(key, 0.0), value)


def check_parity(model, batch: dict, mesh, cp_forward, params: dict | None = None) -> Parity:
    """Run ``cp_forward`` and the plain model on ``batch``; compare loss, logits and every gradient."""
    params = params if params is not None else params_of(model)
    ref_loss, ref_logits, ref_grads = reference(model, params, batch)
    with recording() as log:
        output, grads = value_and_grad(cp_forward)(params, batch, mesh)
    diffs = {"loss": (output.loss.detach() - ref_loss).abs().item()}
    scales = {"loss": ref_loss.abs().item()}
    if output.logits is not None:  # None under logits=False: the loss never holds them
        diffs["logits"] = (output.logits.full_tensor().detach() - ref_logits).abs().max().item()
        scales["logits"] = ref_logits.abs().max().item()
    for name, ref in ref_grads.items():
        group = "grad " + tensor_group(name)
        _update(diffs, group, (grads[name] - ref).abs().max().item())
        _update(scales, group, ref.abs().max().item())
    return Parity(diffs, scales, log.total_bytes)


class Float64(TorchFunctionMode):
    """Every float32 a model's code asks for given as float64 (Inkling2 and HY-V4 cast to fp32 in their
    norms, gates and hyper-connections: ``.float()``, ``dtype=torch.float32``), so that a float64 run stays
    float64 throughout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        args = tuple(torch.float64 if value is torch.float32 else value for value in args)
        kwargs = {key: torch.float64 if v is torch.float32 else v for key, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def beyond_own_rounding(twin, own, params: dict, batch: dict, mesh, cp_forward, rows: list[str]) -> list[str]:
    """Of the gradient ``rows`` failing at 1e-5 of their scale, those where cp lies farther from a float64
    run of the same weights (on ``twin``, a fresh model of ``own``'s config, cast here) than twice one
    process's own fp32 distance from it and than 1e-5 of the row's scale (the other rows as they are).
    fp32 rounding depends on the order of the additions, which cp changes; where one process itself is
    that far from the exact gradient (gemma4_unified_text: 2.7e-5 of scale, cp 1.1e-5; HY-V4's
    hyper-connections, which cancel to 1e-4 of their terms), a gap of that size between the two says
    nothing, and cp within the tolerance of the exact gradient is exact by the tests' own measure, while a
    cp error would lie far outside both."""
    if not any(row.startswith("grad ") for row in rows):
        return rows
    _, grads = value_and_grad(cp_forward)(params, batch, mesh)
    _, _, one = reference(own, params, batch)
    twin = twin.double()
    if hasattr(twin, "set_experts_implementation"):  # grouped_mm takes no float64
        twin.set_experts_implementation("eager")
    with Float64():
        _, _, exact = reference(twin, {name: value.double() for name, value in params.items()}, batch)
    scales: dict[str, float] = {}
    for name, truth in exact.items():
        _update(scales, "grad " + tensor_group(name), truth.abs().max().item())
    farther = set()
    for name, truth in exact.items():
        row = "grad " + tensor_group(name)
        cp_distance, own_distance = ((g.double() - truth).abs().max() for g in (grads[name], one[name]))
        if cp_distance > max(2 * own_distance, RTOL * scales[row]):
            farther.add(row)
    return [row for row in rows if not row.startswith("grad ") or row in farther]
