"""Tensor parallelism inside a cp call: the layout's column-wise and row-wise layers over ``tp``.

The functional call receives each rank's tp block of the split weights (see
:mod:`cpshard.parallel.placement`): column-wise layers (q/k/v, gate/up) compute this rank's heads
or features, and row-wise layers (o/down) a partial sum that one all-reduce over ``tp`` completes.
Where the replicated residual stream enters the column-wise layers, the gradient is a sum of every
tp rank's part: one all-reduce in the backward. Attention sees ``heads / tp`` heads per rank, which
Ulysses then splits over ``cp``. Hooks are installed once per model and act only inside a call with
``tp > 1``.
"""

from __future__ import annotations

import inspect
import re
from functools import cache, partial

from torch import nn

from cpshard.call import current_call
from cpshard.comm.collectives import sum_grads_over_group, sum_over_group
from cpshard.comm.record import serving
from cpshard.interfaces import Hook
from cpshard.layouts.layout import TP_STYLES, Layout, config_field
from cpshard.layouts.structure import submodule, text_config
from cpshard.parallel.adapters import lora_problem, parameters_below, style_in_plan

#: the event name of the sums of the tp entry blocks' input gradients
TP_INPUT = "tp input"


def check_tensor_parallel(model: nn.Module, layout: Layout, tp: int) -> None:
    """The plan names known styles, every count it splits divides by ``tp``, and every block it splits
    holds nothing the split would cut unplaced: a clear error otherwise, before any collective."""
    config = text_config(model)
    unknown = [
        f"{path}: {style!r}" for path, style in layout.tensor_parallel.items() if style not in TP_STYLES
    ]
    if unknown:
        raise ValueError(
            f"layout {layout.name!r}: unknown tensor-parallel styles ({'; '.join(unknown)}); use {TP_STYLES}"
        )
    if tp == 1:
        return
    _check_entries(layout)
    fields = (layout.heads, layout.kv_heads, layout.mlp_width)
    counts = {name: config_field(config, name) for name in fields if name is not None}
    missing = [name for name, count in counts.items() if count is None]
    if missing and any(style == "colwise" for style in layout.tensor_parallel.values()):
        raise ValueError(
            f"layout {layout.name!r} names config fields {', '.join(map(repr, missing))}, which "
            f"{type(config).__name__} lacks (or sets to None): tp={tp} splits the heads and features they "
            "count, unchecked (a typo, or another model's field: `cpshard layout MODEL` prints the layout "
            "cpshard uses)"
        )
    bad = {name: count for name, count in counts.items() if isinstance(count, int) and count % tp}
    if bad:
        raise ValueError(
            f"tp={tp} must divide {', '.join(f'{name}={count}' for name, count in bad.items())}: "
            "each tp rank holds an equal share of the heads and features; choose a tp that divides them"
        )
    layers = submodule(model, layout.decoder_layers)
    problems = [
        (f"{i}.{path}", why)
        for i, layer in enumerate(layers or ())
        for path, why in _split_problems(layer, layout)
    ]
    if problems:
        where, what = problems[0]
        raise ValueError(
            f"{layout.decoder_layers}.{where}: {what}; cpshard's tensor parallelism (layout {layout.name!r}) "
            f"cannot serve it at tp={tp}, and would give wrong results or fail inside the model: run this "
            "model with tp=1 (cp, fsdp and the rest serve it), or give the module a style in a layout file "
            "('per_head' for a weight each head applies alike)"
        )


def _check_entries(layout: Layout) -> None:
    """Every row of the plan sits in a block of ``tensor_parallel_inputs``: where the replicated stream
    enters the split, its gradient is summed over tp there (a column-wise layer outside one would pass each
    rank its own heads' share of it), a per-head weight's gradient sums each rank's heads (outside a split
    block every tp rank sees the whole stream, and the sum would count it tp times), and a row-wise layer
    closes a split that a block opened."""
    outside = [
        f"{path} ({style})"
        for path, style in layout.tensor_parallel.items()
        if style in TP_STYLES
        and not any(path.startswith(f"{entry}.") for entry in layout.tensor_parallel_inputs)
    ]
    if outside:
        raise ValueError(
            f"layout {layout.name!r}: the tensor-parallel rows {', '.join(outside)} sit in no block of "
            f"tensor_parallel_inputs {layout.tensor_parallel_inputs}, where the replicated residual stream "
            "enters the split and its gradient is summed over tp; without one the gradients are wrong. A row "
            "sits in a block when its path is inside the block's ('self_attn.q_proj' in 'self_attn'): name "
            "the block that holds them in tensor_parallel_inputs, or drop the rows (a norm on the residual "
            "stream, as input_layernorm, is replicated: it takes no row)"
        )


#: a block's own code reading the whole model's head count, where a tp rank holds a share of the heads
_HEAD_COUNTS = re.compile(
    r"\bself\.(num_heads|num_attention_heads|num_key_value_heads|n_heads|num_kv_heads)\b"
)


@cache
def _reads_head_count(block_type: type) -> str | None:
    """The head-count attribute that ``block_type``'s forward reshapes by (StableLM's
    ``view(b, s, self.num_heads, d)``), or None: under tp a rank's projections hold heads / tp."""
    try:
        found = _HEAD_COUNTS.search(inspect.getsource(block_type.forward))
    except (OSError, TypeError):
        return None
    return found.group(0) if found else None


def _split_problems(layer: nn.Module, layout: Layout) -> list[tuple[str, str]]:
    """``(module path in the layer list, why)`` for what the plan's split of this layer's blocks would cut
    unplaced: a parameter of a split block (self_attn, mlp) that the plan places nowhere (each tp rank
    would apply all of it to its own heads or features: Olmo2's q_norm over every head's width, BitNet's
    sub-norms, Apertus' xIELU parameters, Cohere's per-head norm of shape (heads, head_dim)), and a
    block's code that reads the whole model's head count; and a split that does not close: a block with
    column-wise layers and no row-wise one (its output would leave it split over tp), or the reverse (a
    row-wise layer would take a whole input as its share)."""
    problems = []
    for path in layout.tensor_parallel_inputs:
        block = submodule(layer, path)
        if block is None or holds_experts(layer, path, layout):
            continue
        opens, closes = holds_colwise(layer, path, layout), _holds_style(layer, path, layout, "rowwise")
        if opens != closes:
            problems.append((path, _UNCLOSED[opens]))
        elif opens:
            problems += _block_problems(block, path, layout)
        elif _holds_style(layer, path, layout, "per_head"):
            problems.append((path, _PER_HEAD_UNSPLIT))
    return problems


#: why a split that does not close fails, by whether the block holds column-wise layers
_UNCLOSED = {
    True: "holds column-wise layers and no row-wise one here, so its output would leave it split over tp "
    "(the layer that writes the block's output, as o_proj or down_proj, is 'rowwise')",
    False: "holds a row-wise layer and no column-wise one here, so the row-wise layer would take its whole "
    "input as its share (the layers that read the block's input, as q_proj or up_proj, are 'colwise')",
}
#: why a per-head row in a block tp does not split fails
_PER_HEAD_UNSPLIT = (
    "holds per-head rows and no column-wise layer here: every tp rank runs all of its heads, so the per-head "
    "gradient summed over tp would count each head tp times (drop the per_head rows where the block's heads "
    "are not split)"
)


def _block_problems(block: nn.Module, path: str, layout: Layout) -> list[tuple[str, str]]:
    """What the split of ``block`` (at ``path`` in its layer) would cut unplaced: see _split_problems."""
    styles = {
        p[len(path) + 1 :]: style for p, style in layout.tensor_parallel.items() if p.startswith(f"{path}.")
    }
    split = {
        getattr(m, "out_features", None): f"{path}.{p}"
        for p, m in block.named_modules()
        if styles.get(p) == "colwise"
    }
    problems = [
        (f"{path}.{p}", why)
        for p, style in styles.items()
        if (module := submodule(block, p)) is not None
        and parameters_below(module)
        and (why := lora_problem(module, style))
    ]
    for name, param in block.named_parameters():
        owner, _, own = name.rpartition(".")
        if style_in_plan(owner, styles):
            continue
        # a vector as wide as a split output: a norm over every head's width (its statistic needs them all)
        spans = next((split[n] for n in param.shape if n in split), None) if param.dim() == 1 else None
        why = (
            f"spans the whole output of {spans}, which tp splits: each tp rank holds a share of that width"
            " (a norm over every head's width needs its statistic over all of them)"
            if spans
            else "sits in a block tp splits, placed nowhere by the plan: each tp rank would apply it whole "
            "to its own share of the heads or features, and count its gradient on that share alone"
        )
        problems.append((f"{path}.{owner}" if owner else path, f"its {own} {tuple(param.shape)} {why}"))
    count = _reads_head_count(type(block))
    if count:
        why = f"its forward reshapes by {count}, the whole model's head count, where a tp rank holds a share"
        problems.append((path, why))
    return problems


def _tp_group():
    call = current_call()
    return None if call is None else call.tp_group


@serving("tp")
def _sum_input_grads(module, args, kwargs):
    group = _tp_group()
    if group is None:
        return None
    if args:
        return (sum_grads_over_group(args[0], group, TP_INPUT), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": sum_grads_over_group(kwargs["hidden_states"], group, TP_INPUT)}


@serving("tp")
def _sum_outputs(name: str, module, args, output):
    group = _tp_group()
    return None if group is None else sum_over_group(output, group, name)


def _holds_any(layer: nn.Module, path: str, paths) -> bool:
    """Whether one of ``paths`` (module paths inside a decoder layer) is the module at ``path`` or inside
    it, and this layer has it."""
    inside = [p for p in paths if p == path or p.startswith(f"{path}.")]
    return any(submodule(layer, p) is not None for p in inside)


def holds_colwise(layer: nn.Module, path: str, layout: Layout) -> bool:
    """The module at ``path`` holds a column-wise layer of the plan in this layer. A hybrid's mixer of another
    kind under the same name (Nemotron-H's Mamba2 ``mixer`` beside its attention ``mixer``) runs whole on
    every tp rank: its input gradient is whole there already, and summing it over tp would count it tp
    times."""
    colwise = [p for p, style in layout.tensor_parallel.items() if style == "colwise" and p != path]
    return _holds_any(layer, path, colwise)


def _holds_style(layer: nn.Module, path: str, layout: Layout, style: str) -> bool:
    """The module at ``path`` holds a module of the plan's ``style`` in this layer."""
    return _holds_any(layer, path, [p for p, s in layout.tensor_parallel.items() if s == style])


def holds_experts(layer: nn.Module, path: str, layout: Layout) -> bool:
    """The module at ``path`` holds one of the layer's experts modules (a MoE block: its router runs
    replicated and :mod:`cpshard.parallel.experts` sums its experts' input gradients over tp itself)."""
    return _holds_any(layer, path, layout.experts)


def tensor_parallel_sums(layers: nn.ModuleList, layout: Layout) -> list[tuple[str, str, nn.Module]]:
    """``(event name, phase, module)`` for every sum over tp of the residual stream a call makes: each
    decoder layer's tp entry modules' input gradients in the backward (MoE blocks aside) and its
    row-wise layers' outputs in the forward. The hooks sum there; the communication optimum counts them."""
    rowwise = [path for path, style in layout.tensor_parallel.items() if style == "rowwise"]
    sums = []
    for layer in layers:
        for path in layout.tensor_parallel_inputs:
            module = submodule(layer, path)
            if (
                module is not None
                and holds_colwise(layer, path, layout)
                and not holds_experts(layer, path, layout)
            ):
                sums.append((TP_INPUT, "backward", module))
        for path in rowwise:
            module = submodule(layer, path)
            if module is not None:
                sums.append((f"tp {path}", "forward", module))
    return sums


def tensor_parallel_hooks(layers: nn.ModuleList, layout: Layout) -> list[Hook]:
    """The hooks of :func:`tensor_parallel_sums`: input gradients summed before an entry module, outputs
    summed after a row-wise layer."""
    return [
        Hook(module, _sum_input_grads, pre=True)
        if phase == "backward"
        else Hook(module, partial(_sum_outputs, name), pre=False)
        for name, phase, module in tensor_parallel_sums(layers, layout)
    ]
