"""PEFT's LoRA on a layer of the tensor-parallel plan: how its parts split with the layer they wrap.

LoRA wraps a layer ``W`` of the plan as ``W.base_layer`` (the layer itself) beside ``W.lora_A.<adapter>``
(``r x in``) and ``W.lora_B.<adapter>`` (``out x r``), and adds ``scaling * B(A(x))`` to its output. Under tp:

- a column-wise ``W`` (q/k/v, gate/up) reads the whole input and writes this rank's outputs: ``A`` is
  replicated and ``B`` is column-wise. ``A``'s gradient comes from this rank's share of the outputs, so it
  sums over tp, as a per-head weight's does;
- a row-wise ``W`` (o/down) reads this rank's share of the input and writes a partial sum: ``A`` is
  row-wise, so ``A(x)`` is a partial sum too, and ``W``'s own sum over tp completes ``B(A(x))`` with the
  rest. ``B`` is replicated, and its gradient (the whole output's gradient times the partial ``A(x)``)
  sums over tp.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

#: a LoRA part's style, by the style of the layer of the plan it sits in
_PART_STYLES = {
    "base_layer": {"colwise": "colwise", "rowwise": "rowwise"},
    "lora_A": {"colwise": "per_head", "rowwise": "rowwise"},
    "lora_B": {"colwise": "colwise", "rowwise": "per_head"},
}


def part_style(part: str, style: str) -> str | None:
    """The style of a parameter of the module at ``part`` below a layer of the plan whose style is ``style``
    (``base_layer``, ``lora_A.<adapter>``), or None where LoRA puts nothing there."""
    name, _, adapter = part.partition(".")
    named = not adapter if name == "base_layer" else bool(adapter) and "." not in adapter
    return _PART_STYLES[name].get(style) if name in _PART_STYLES and named else None


def style_in_plan(module: str, plan: Mapping[str, str]) -> str | None:
    """The ``plan``'s style of the module at ``module`` (paths as the plan writes them), or of the LoRA part
    it is of a layer of the plan; None where the plan places it nowhere."""
    if module in plan:
        return plan[module]
    below = (p for p in plan if module.startswith(f"{p}."))
    return next((part_style(module[len(p) + 1 :], plan[p]) for p in below), None)


def parameters_below(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters that sit in modules below it (an adapter's, a wrapper's)."""
    return [name for name, _ in module.named_parameters() if "." in name]


def lora_problem(module: nn.Module, style: str) -> str | None:
    """Why the parameters below ``module`` (a layer of the plan whose style is ``style``) cannot be split
    as :func:`part_style` splits them, or None: only PEFT's LoRA linear layer adds ``B(A(x))`` to its
    output, and its variants (DoRA) and dropout (a mask drawn per tp rank on the replicated input) do
    more; a bias of ``B`` beside a row-wise layer would be added once per tp rank."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # without PEFT no module is its LoRA layer
        Linear = ()
    if not isinstance(module, Linear):
        kind = type(module).__name__
        return f"is a {kind} with parameters in modules below it: tp splits those of PEFT's LoRA Linear alone"
    if module.lora_variant:
        variants = sorted(module.lora_variant)
        return f"is a LoRA layer with the variant {variants} (as DoRA), which tp does not split"
    if any(not isinstance(dropout, nn.Identity) for dropout in module.lora_dropout.values()):
        return "is a LoRA layer with dropout, whose mask each tp rank would draw alone: set lora_dropout=0"
    if style == "rowwise" and any(layer.bias is not None for layer in module.lora_B.values()):
        return "is a row-wise LoRA layer with lora_bias, which each tp rank would add: set lora_bias=False"
    return None
