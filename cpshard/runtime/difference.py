"""What differs between cp and one process on the layout probe's batch (:mod:`cpshard.runtime.probe`
decides when to probe and how to refuse).

Each decoder layer's output at the real positions a rank holds, then the logits, then every gradient of the
next-token loss (a backward can differ where the forward agrees), cp's against one process's on the same
weights. In a half type a row beyond the tolerance gets a second look against one process run on the weights
cast to fp32: it passes where cp lies no farther from that than twice one process in the half type does. Under
autocast (both runs in it) the rows are held as a half type's, and the second look runs on the weights cast to
float64, which autocast does not cast. The one-process references run on every rank, and a failure on any rank
is made every rank's (:func:`on_every_rank`), so that no rank waits for another in the probe's collectives.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import split_call
from cpshard.comm.arrival import arriving
from cpshard.comm.carrier import carried
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.structure import recurrent_module, text_config
from cpshard.parallel.mesh import cp_rank, cp_size
from cpshard.precision import autocast_dtype, autocast_off
from cpshard.runtime.grad import value_and_grad
from cpshard.spec.sequence import chunk_positions, positions

#: a layer's output passes when it is this close, relative to its scale (fp32), and in a half type
RTOL, HALF_RTOL = 1e-4, 1e-2
HALF_TYPES = (torch.bfloat16, torch.float16)


def _half_type(params: dict) -> torch.dtype | None:
    """The half type of a model's weights (None: none is), which every row of its probe is held to
    (:data:`HALF_RTOL`), whatever type the row comes in (xLSTM's bf16 model gives fp32 logits)."""
    return next((value.dtype for value in params.values() if value.dtype in HALF_TYPES), None)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    scale = want.abs().max().clamp(min=1.0)
    return got.shape == want.shape and bool((got - want).abs().max() <= rtol * scale)


def _first(output):
    return output[0] if isinstance(output, tuple | list) else output  # OpenAI GPT's blocks: a list


def _batch_and_sequence_first(hidden: torch.Tensor, stream) -> torch.Tensor:
    """A layer's output with its batch and sequence dims first, where the residual ``stream``'s spec puts
    them elsewhere (Gemma 3n's copies ``n b s d``), so that one process and cp compare the same rows."""
    names = [dim.name for dim in stream.dims]
    return (
        hidden.movedim((names.index("b"), names.index("s")), (0, 1)) if hidden.dim() == len(names) else hidden
    )


def _layer_outputs(layers, final, stream, run) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each layer's output hidden states during ``run()`` (batch and sequence first, whatever the residual
    ``stream``'s spec) and, under a cp call, the real positions this rank holds (None outside one: the
    whole sequence). The ``final`` module's output (a post-norm decoder's last layer) is already back in
    contiguous order, its real rows first."""
    outputs = []

    def keep(module, args, output):
        hidden, call, held = _batch_and_sequence_first(_first(output), stream), split_call(), None
        if call is not None and module is final:
            held = chunk_positions(call.length, call.cp_size, cp_rank(call.mesh))
            hidden = hidden[:, : len(held)]
        elif call is not None:
            held = positions(call.order, call.padded_length, call.cp_size, cp_rank(call.mesh))
            real = held < call.length
            hidden, held = hidden[:, real], held[real]
        outputs.append((hidden.detach(), held))

    handles = [layer.register_forward_hook(keep) for layer in layers]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def _probe_batch(model, per_rank: int, cp: int, device) -> dict:
    """Two rows of ``per_rank * cp + 1`` token ids spread over the vocabulary (odd: the cp padding is
    exercised), the second padded at its positions 1 to ``per_rank`` (a padding mask is where masks and
    positions go wrong; its first token real, so that every query sees a key: the ring refuses rows that
    see none where a family's own code gives them another gradient), and the labels of the real positions."""
    vocab = max(getattr(text_config(model), "vocab_size", 8) - 3, 1)
    length = per_rank * cp + 1
    ids = (torch.arange(2 * length) * 7).remainder(vocab).add(3).view(2, -1).to(device)
    mask = torch.ones_like(ids)
    mask[1, 1 : per_rank + 1] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _real(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``values`` ``[B, T, ...]`` with the padded positions (``real`` ``[B, T]`` false) zeroed: what a pad
    position's query computes is read by no real token, and cp need not agree with one process there."""
    return values * real.view(*real.shape, *[1] * (values.dim() - 2)).to(values.dtype)


def tokens_per_rank(layers, layout) -> int:
    """Three, or the widest halo a recurrent mixer's convolution reads (LFM3's: 6), so that every rank's
    slice of the probe holds what its convolution reads before it."""
    mixers = [found[0] for layer in layers if (found := recurrent_module(layer, layout.recurrent))]
    widths = [m.kernel_size[0] - 1 for mixer in mixers for m in mixer.modules() if isinstance(m, nn.Conv1d)]
    return max([3, *widths])


class _Row(NamedTuple):
    """One comparison of the probe: what it compares (as the error says it), cp's values and one process's,
    and the parameter a gradient row is of."""

    what: str
    cp: torch.Tensor
    plain: torch.Tensor
    parameter: str | None = None


class Difference(NamedTuple):
    """What the probe found on this rank: the names of its rows, in the order it reports them (the same on
    every rank), the index of the first that differs here (``len(rows)``: none), and a note on it."""

    rows: tuple[str, ...]
    first: int
    note: str = ""

    def named(self, index: int) -> str:
        """Row ``index`` as the error names it (with this rank's note where it is this rank's first)."""
        note = self.note if index == self.first else ""
        return f"{self.rows[index]} differs between cp and one process{note}"


def earliest_difference(found: Difference, mesh) -> int | None:
    """On every rank, the earliest row that differs on any cp rank, None where nothing differs anywhere: one
    all-reduce, after every rank's probe ran to its end, so that every rank names the same row (every rank
    has the same rows, so ``len(rows)``, none, is the same everywhere)."""
    group = mesh.get_group("cp")
    index = carried(torch.tensor([found.first], dtype=torch.int64), group)
    with arriving("all_reduce", "probe verdict", group):
        dist.all_reduce(index, op=dist.ReduceOp.MIN, group=group)
    earliest = int(index.item())
    return None if earliest == len(found.rows) else earliest


def first_difference(cp_forward, params: dict, mesh) -> Difference:
    """What differs first between cp and one process on the probe batch, on this rank; in a half type (the
    weights', or autocast's), a row beyond the tolerance gets a second look, against one process in fp32 (in
    float64 under autocast: :func:`_beyond_half_rounding`). :func:`earliest_difference` agrees on it."""
    model, layout = cp_forward.model, cp_forward.layout
    layers = model.get_submodule(layout.decoder_layers)
    batch = _probe_batch(
        model, tokens_per_rank(layers, layout), cp_size(mesh), next(iter(params.values())).device
    )
    real, results = batch["attention_mask"] == 1, {}

    def under_cp():  # with the labels: a forward made with token_logprobs or token_statistics needs them
        results["cp"] = cp_forward(params, batch, mesh)

    seen = {}  # the autocast type the decoder runs under (the caller's autocast, or accelerate's wrapper's)
    with torch.no_grad(), _autocast_seen(model.get_submodule(layout.decoder), seen):
        plain = on_every_rank(lambda: _one_process_outputs(model, params, batch, layout), mesh)
    with torch.no_grad():
        ours = _layer_outputs(layers, model.get_submodule(layout.final_norm), layout.hidden[0], under_cp)
    plain_gradients = on_every_rank(lambda: _one_process_gradients(model, params, batch), mesh)
    # every rank runs every collective of the probe, whatever it found: an early return would hang the others
    _, gradients = value_and_grad(cp_forward)(params, batch, mesh)
    logits = results["cp"].logits
    cp = (ours, None if logits is None else logits.full_tensor(), gradients)
    half = _half_type(params) or seen.get("dtype")  # the type the rows are rounded in, if a half type
    rows = _rows(layout, cp, (*plain, plain_gradients), real)
    differing = [
        (row, "") for row in rows if not _close(row.cp, row.plain, RTOL if half is None else HALF_RTOL)
    ]
    if differing and half is not None:
        wide = torch.float64 if "dtype" in seen else torch.float32  # autocast leaves float64 as it is
        differing = _beyond_half_rounding(
            model, params, batch, layout, cp, [row for row, _ in differing], half, wide
        )
    names = tuple(row.what for row in rows)
    if not differing:
        return Difference(names, len(rows))
    (row, note), *_ = differing
    return Difference(names, next(i for i, each in enumerate(rows) if each is row), note)


@contextmanager
def _autocast_seen(decoder: nn.Module, seen: dict):
    """Note in ``seen["dtype"]`` the autocast type where ``decoder`` runs (absent where autocast is off)."""

    def note(module, args):
        dtype = autocast_dtype(next(module.parameters()).device.type)
        if dtype is not None:
            seen["dtype"] = dtype

    handle = decoder.register_forward_pre_hook(note)
    try:
        yield
    finally:
        handle.remove()


def _one_process_outputs(model, params: dict, batch: dict, layout) -> tuple[list, torch.Tensor]:
    """One process's layer outputs (whole sequences) and logits on ``batch``, without gradients."""
    results = {}
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}

    def plain():
        with one_process():
            results["plain"] = torch.func.functional_call(
                model, params, (), {**inputs, "use_cache": False}, strict=False, tie_weights=True
            )

    layers, final = model.get_submodule(layout.decoder_layers), model.get_submodule(layout.final_norm)
    outputs = _layer_outputs(layers, final, layout.hidden[0], plain)
    return outputs, results["plain"].logits


def _one_process_gradients(model, params: dict, batch: dict, names=None) -> dict:
    """One process's gradient of the probe's loss for every parameter, or those ``names`` (zeros where the
    loss reads none)."""
    names = list(params) if names is None else names
    wanted = set(names)
    leaves = {name: value.detach().requires_grad_(name in wanted) for name, value in params.items()}
    with one_process():
        inputs = {**batch, "use_cache": False}
        loss = torch.func.functional_call(model, leaves, (), inputs, strict=False, tie_weights=True).loss
        grads = torch.autograd.grad(loss, [leaves[name] for name in names], allow_unused=True)
    return {
        name: torch.zeros_like(leaves[name]) if grad is None else grad for name, grad in zip(names, grads)
    }


def _rows(layout, cp, plain, real: torch.Tensor) -> list[_Row]:
    """Each layer's output at the real positions this rank holds, the logits at the real positions, and each
    gradient ``plain`` has, in the order the probe reports the first that differs. ``cp`` and ``plain`` are
    each ``(layer outputs, logits, gradients)``, their logits whole (no collective here: the half types'
    second look runs on the ranks that need it only)."""
    (ours, cp_logits, cp_gradients), (theirs, logits, gradients) = cp, plain
    rows = [
        _Row(
            f"the output of {layout.decoder_layers}.{i}",
            _real(mine, real[:, held]),
            _real(whole[:, held], real[:, held]),
        )
        for i, ((mine, held), (whole, _)) in enumerate(zip(ours, theirs, strict=True))
    ]
    if cp_logits is not None:
        what = "the logits (every layer agrees: look at the final norm and the LM head)"
        rows.append(_Row(what, _real(cp_logits, real), _real(logits, real)))
    return rows + [
        _Row(f"the gradient of {name}", cp_gradients[name], want, name) for name, want in gradients.items()
    ]


#: in a half type, a row beyond the tolerance passes where cp lies no farther from one process in fp32 than
#: this many times one process in the half type does (the check's and the zoo's rule against float64)
HALF_ROUNDING = 2


def _beyond_half_rounding(
    model, params: dict, batch: dict, layout, cp, differing: list[_Row], half: torch.dtype, wide: torch.dtype
) -> list:
    """Of the ``differing`` rows, those where cp lies farther from one process in the ``wide`` type (the same
    weights, cast; fp32, or float64 under autocast, which casts no float64 input) than
    :data:`HALF_ROUNDING` times one process in the ``half`` type (the weights', or autocast's) does, each as
    ``(row, a note of the two distances)``: a cp error keeps its size in any type, a half type's rounding
    does not (RWKV's WKV scan and MiniMax's lightning attention in bf16 lie 1.7e-2 and 1e-2 of scale apart on
    the probe batch at cp 4, exact in fp32). The wide run takes the gradients of the differing rows'
    parameters alone (a copy of the weights in the wide type is the look's memory). No collective: each rank
    judges its rows, and :func:`earliest_difference` agrees. Where the wide run raises (memory, a model that
    casts to its config's dtype), every differing row stands, noted so."""
    widened = {name: value.to(wide) if value.is_floating_point() else value for name, value in params.items()}
    names = [row.parameter for row in differing if row.parameter is not None]
    wide_name, name = (str(dtype).removeprefix("torch.") for dtype in (wide, half))
    wide_name = "fp32" if wide == torch.float32 else wide_name
    try:
        with autocast_off(), _eager_experts(model, wide):
            with torch.no_grad():
                outputs = _one_process_outputs(model, widened, batch, layout)
            gradients = _one_process_gradients(model, widened, batch, names) if names else {}
        real = batch["attention_mask"] == 1
        exact = {row.what: row.plain for row in _rows(layout, cp, (*outputs, gradients), real)}
    except Exception as error:  # noqa: BLE001 -- the half type's verdict stands
        cause = error.__cause__ if isinstance(error, OneProcessFailed) else error
        note = f" (a second look against one process in {wide_name} raised {type(cause).__name__}: {cause})"
        return [(row, note) for row in differing]
    beyond = []
    for row in differing:
        right = exact[row.what]
        scale = right.abs().max().clamp(min=1.0)
        ours, own = _distance(row.cp, right) / scale, _distance(row.plain, right) / scale
        if ours > HALF_ROUNDING * own:
            note = f"cp lies {ours:.1e} of scale from one process in {wide_name}, one process in {name}"
            note += f" {own:.1e}"
            beyond.append((row, f" (beyond {name}'s rounding: {note})"))
    return beyond


@contextmanager
def _eager_experts(model, wide: torch.dtype):
    """Inside, a float64 look runs the model's experts eagerly (grouped matmuls take no float64: DeepSeek-V4's
    and Qwen4-Exp's looks raised); outside, they run as they did."""
    current = getattr(model.config, "_experts_implementation", None)
    settable = hasattr(model, "set_experts_implementation")
    if wide != torch.float64 or current in (None, "eager") or not settable:
        yield
        return
    model.set_experts_implementation("eager")
    try:
        yield
    finally:
        model.set_experts_implementation(current)


def _distance(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference, in fp32 (infinite where the shapes differ)."""
    return float((got.float() - want.float()).abs().max()) if got.shape == want.shape else float("inf")


def on_every_rank(local, mesh):
    """``local()``, a part of the probe with no collective inside (the one-process reference), whose failure
    on any cp rank is made every rank's: a rank it failed on (out of memory, say) leaves the probe, and the
    others would wait for it in the probe's next collective. The rank it failed on raises its error; the
    others a LayoutError saying where to look."""
    try:
        result, error = local(), None
    except Exception as raised:  # noqa: BLE001 -- re-raised below, after every rank knows
        result, error = None, raised
    failing = failing_rank(error is not None, mesh)
    if error is not None:
        raise error
    if failing is not None:
        raise LayoutError(
            f"cpshard cannot vouch for this model: the probe's one-process reference raised on cp rank "
            f"{failing} (its error, raised there, says what; often memory: the reference runs the whole "
            "probe batch on each rank)"
        )
    return result


def failing_rank(failed: bool, mesh) -> int | None:
    """On every rank, the last cp rank on which ``failed`` holds, None where it holds on none (one
    all-reduce): what lets every rank leave the probe together."""
    group = mesh.get_group("cp")
    flag = carried(torch.tensor([cp_rank(mesh) + 1 if failed else 0], dtype=torch.int64), group)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) - 1 if flag.item() else None


class OneProcessFailed(Exception):
    """A one-process reference (the model's own forward, no cp: the probe's, the parity check's) raised: the
    model does not run as it is configured, whatever cp does."""

    def __str__(self) -> str:
        cause = self.args[0]
        return f"{type(cause).__name__}: {cause}"


@contextmanager
def one_process():
    """Run the probe's reference: what it raises is the model's own failure, told apart from cp's."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 -- re-raised, marked
        raise OneProcessFailed(error) from error
