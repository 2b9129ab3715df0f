"""``cpshard check MODEL --cp N``: is this model exact under cp? Loss, logits and gradients, one row each.

MODEL is a local folder (a transformers config, with or without weights) or a model type name
(a small random model of that type, :func:`cpshard.tools.tiny.tiny_model`). Every usage problem is
found in this process before any rank starts, on a meta-device copy of the model, so that a
bad invocation costs a second and says one line. Then ``cp`` local CPU ranks each run
:func:`cpshard.tools.parity.check_parity`: the cp run against the plain model on the whole sequence.

A row passes when its largest difference is at most ``rtol`` times the largest reference value
in that row: fp32 ``1e-5`` (what the demo and tests hold cp to); bf16 ``5e-2``, about six bf16
roundings (``2**-7`` each): the cp run sums in another order (gradients over ranks, ring attention
over blocks; up to ``3.5e-2`` was seen), so bf16 catches gross errors and fp32 proves exactness. A row
beyond its tolerance gets a second look against runs in a wider type (float64 for fp32, fp32 for bf16:
:class:`cpshard.tools.parity.Rounding`): one process's rounding can be as large as the gap (PhiMoE's router
in bf16 picks other experts than in fp32), and cp's run in the wider type shows whether cp computes what one
process computes.
"""

from __future__ import annotations

import sys
import time

import torch

from cpshard.attention.choice import choose_implementation
from cpshard.layouts.layout import Layout
from cpshard.layouts.registry import resolve_layout
from cpshard.layouts.structure import text_config
from cpshard.parallel.mesh import make_mesh
from cpshard.parallel.processes import LocalRanks, RankError
from cpshard.runtime.forward import make_cp_forward, params_of
from cpshard.tools.check_config import ATTNS, DTYPES, CheckConfig
from cpshard.tools.check_report import exit_status, format_report, reported, rounding_names
from cpshard.tools.model_source import build_model, chosen_attention, hf_config, resolve_source
from cpshard.tools.parity import (
    WIDER,
    Parity,
    Rounding,
    check_parity,
    failing_rows,
    float64_distances,
    widened,
)
from cpshard.tools.tiny import causal_lm, tiny_batch
from cpshard.tools.usage import UsageError, say

#: the check's names (ATTNS, CheckConfig and the report's two: promised here, docs/API.md)
__all__ = [
    "ATTNS",
    "CheckConfig",
    "check_job",
    "exit_status",
    "float64_look",
    "format_report",
    "plan",
    "rounding_job",
    "run_check",
]


def plan(config: CheckConfig, layout: Layout | str = "auto") -> str:
    """Find every usage problem before ranks start; what cp will run, in words.

    The model is built on the meta device: its structure and config, none of its memory."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    source = resolve_source(config.model)
    try:
        model_config = hf_config(source, config.settings)
        if model_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise UsageError(f"model type {model_config.model_type!r} has no causal LM in transformers")
        with torch.device("meta"):
            model = causal_lm(model_config)
    except UsageError:
        raise
    except Exception as error:  # noqa: BLE001 -- transformers' validators raise many types
        raise UsageError(
            f"cannot build {source.describe()}: {type(error).__name__}: {' '.join(str(error).split())}; "
            "set the config fields it needs with --set key=value"
        ) from None
    chosen = resolve_layout(model, layout)  # a LayoutError: cpshard refuses the model (exit status 1)
    try:
        heads = chosen.head_counts(text_config(model))[0]
        implementation, degree = choose_implementation(config.implementation, heads, config.cp)
    except (ValueError, OSError, KeyError) as error:
        raise UsageError(" ".join(str(error).split())) from None
    attn = chosen_attention(model_config, source, config.attn)
    how = implementation + (f", Ulysses degree {degree}" if implementation == "hybrid" else "")
    extras = [f"{config.pad} padding" if config.pad else "", "packed documents" if config.packed else ""]
    shape = ", ".join(filter(None, [f"batch {config.batch} x {config.seq} tokens", *extras]))
    dtype = config.dtype + (f" under {config.autocast} autocast" if config.autocast else "")
    return f"{source.describe()}, {dtype}, {attn} attention, {shape}; cp={config.cp} ({how})"


def _setup(config: CheckConfig, layout: Layout | str):
    """The model, the batch, the mesh and the cp forward of one rank's check."""
    mesh = make_mesh(cp=config.cp)
    model = build_model(resolve_source(config.model), config)
    batch = tiny_batch(
        text_config(model).vocab_size,
        config.batch,
        config.seq,
        pad=config.pad,
        packed=config.packed,
        seed=config.seed + 1,
    )
    return model, batch, mesh, make_cp_forward(model, layout=layout, implementation=config.implementation)


def check_job(config: CheckConfig, layout: Layout | str = "auto") -> Parity:
    """One rank's check: build the model and batch, run cp and one process, compare.

    ``layout`` is for tests and layout authors (a deliberately broken one must fail)."""
    model, batch, mesh, cp_forward = _setup(config, layout)
    with config.under_autocast():
        return check_parity(model, batch, mesh, cp_forward)


def rounding_job(config: CheckConfig, layout: Layout | str = "auto") -> Rounding:
    """One rank's second look at a check that failed: cp and one process against a run of the same weights
    and batch in a wider type (float64; fp32 for bf16), and cp run in that type too."""
    model, batch, mesh, cp_forward = _setup(config, layout)
    source = resolve_source(config.model)
    twin, cp_twin = (build_model(source, config) for _ in range(2))
    wide = WIDER[DTYPES[config.dtype]]
    twin_forward = make_cp_forward(
        widened(cp_twin, wide), layout=layout, implementation=config.implementation
    )
    with config.under_autocast():  # autocast leaves the float64 runs as they are
        return float64_distances(twin, model, params_of(model), batch, mesh, cp_forward, twin_forward)


def _ready() -> bool:
    """A no-op on every rank: it returns once all of them have joined the group."""
    return True


def float64_look(ranks: LocalRanks, config: CheckConfig, layout, out) -> list[Rounding] | None:
    """Every rank's :func:`rounding_job`, or None (said) where it cannot run: the first verdict stands."""
    try:
        return ranks.run(rounding_job, config, layout)
    except RankError as error:
        narrow, wide = rounding_names(config)
        out(f"  the {wide} run failed, so the {narrow} verdict stands: {str(error).splitlines()[0]}")
        return None


def run_check(config: CheckConfig, out=say, layout: Layout | str = "auto") -> int:
    """Check on fresh local ranks and print the report; the exit status (0 pass, 1 fail).

    Raises :class:`UsageError` (before starting anything) when the invocation cannot run."""
    out(f"cpshard check: {plan(config, layout)}")
    out(f"  starting {config.cp} local CPU ranks (gloo) ...")
    start = time.perf_counter()
    with LocalRanks(config.cp) as ranks:
        try:
            ranks.run(_ready)
            out(f"  ranks ready in {time.perf_counter() - start:.1f} s; running cp and one process ...")
            start = time.perf_counter()
            parities = ranks.run(check_job, config, layout)
            roundings = None
            if failing_rows(parities, config.rtol):
                out(
                    f"  ran in {time.perf_counter() - start:.1f} s; rows differ beyond {config.rtol:g} x "
                    f"scale: comparing cp and one process with a run in {rounding_names(config)[1]} ..."
                )
                start = time.perf_counter()
                roundings = float64_look(ranks, config, layout, out)
        except RankError as error:
            print(f"cpshard check: {reported(error)}", file=sys.stderr, flush=True)
            return 1
    out(f"  ran in {time.perf_counter() - start:.1f} s\n")
    out(format_report(config, parities, roundings))
    return exit_status(config, parities, roundings)
