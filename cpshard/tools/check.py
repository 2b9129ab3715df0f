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

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cpshard.attention.choice import IMPLEMENTATIONS, choose_implementation
from cpshard.layouts.layout import Layout
from cpshard.layouts.registry import REGISTERED, resolve_layout
from cpshard.layouts.structure import text_config
from cpshard.parallel.mesh import make_mesh
from cpshard.parallel.processes import LocalRanks, RankError
from cpshard.runtime.forward import make_cp_forward, params_of
from cpshard.tools.parity import (
    RTOL,
    WIDER,
    Parity,
    Rounding,
    check_parity,
    failing_rows,
    float64_distances,
    format_rows,
    widened,
)
from cpshard.tools.tiny import causal_lm, tiny_batch, tiny_config, tiny_model
from cpshard.tools.usage import UsageError, say

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: per dtype, the largest difference a row may have, relative to the row's reference scale
RTOLS = {"float32": RTOL, "bfloat16": 5e-2}
#: the names the report gives a check's dtype and the wider one of its second look (:data:`WIDER`)
SHORT_NAMES = {torch.float64: "float64", torch.float32: "fp32", torch.bfloat16: "bf16"}
#: "auto": sdpa where the model supports it, else eager (GPT-Neo, MPT, XLM, DeepSeek-V4 have no sdpa)
ATTNS = ("auto", "sdpa", "eager")
PADS = ("left", "right")
#: the files a folder's weights may come in; without any, the folder's config gets random weights
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass(frozen=True)
class CheckConfig:
    """The check's options: ``cpshard check MODEL --cp N --<field> ...``."""

    model: str
    cp: int = 2
    implementation: str = "auto"
    seq: int = 64
    batch: int = 2
    pad: str | None = None
    packed: bool = False
    dtype: str = "float32"
    attn: str = "auto"
    seed: int = 0
    #: a row passes within this times its scale (None: the dtype's :data:`RTOLS`)
    tolerance: float | None = None
    #: config fields set over the model's (``--set key=value``): ``(key, value)`` pairs
    overrides: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        for name in ("cp", "seq", "batch"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name}={getattr(self, name)} must be at least 1")
        for name, allowed in (
            ("implementation", IMPLEMENTATIONS),
            ("dtype", DTYPES),
            ("attn", ATTNS),
            ("pad", PADS),
        ):
            value = getattr(self, name)
            if value not in allowed and not (name == "pad" and value is None):
                raise UsageError(f"--{name}={value!r}: choose one of {', '.join(allowed)}")
        if self.tolerance is not None and not self.tolerance > 0:
            raise UsageError(f"--rtol={self.tolerance}: a tolerance is a positive number")
        if self.pad and self.seq < 4:  # tiny_batch pads a row by up to half its length
            raise UsageError(f"--pad {self.pad} needs --seq of at least 4: shorter rows get no padding")
        if self.packed and self.seq < 2:
            raise UsageError("--packed needs --seq of at least 2: one token cannot hold several documents")

    @property
    def settings(self) -> dict:
        return dict(self.overrides)

    @property
    def rtol(self) -> float:
        return RTOLS[self.dtype] if self.tolerance is None else self.tolerance


def parse_override(text: str) -> tuple[str, object]:
    """``key=value`` from the command line: the value as JSON (numbers, true/false, null, lists), else
    the plain string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise UsageError(
            f"--set {text!r}: write --set key=value, with key a config field (e.g. num_hidden_layers=4)"
        )
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


# ---------------------------------------------------------------- where the model comes from


@dataclass(frozen=True)
class ModelSource:
    """A model type (random weights), or a folder with its weights or without (random weights)."""

    model_type: str | None = None
    folder: str | None = None
    weights: bool = False

    def describe(self) -> str:
        if self.folder is None:
            return f"random {self.model_type} (small)"
        return f"{self.folder} ({'its weights' if self.weights else 'random weights'})"


def resolve_source(model: str) -> ModelSource:
    """Decide whether ``model`` names a folder (which wins over a type of the same name) or a model type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"the folder {model!r} has no config.json (save one with config.save_pretrained)"
            )
        weights = any((path / name).is_file() for name in WEIGHT_FILES)
        return ModelSource(folder=str(path.resolve()), weights=weights)
    if path.exists():
        raise UsageError(f"{model!r} is a file; give a model folder (with config.json) or a model type")
    if model in CONFIG_MAPPING:
        return ModelSource(model_type=model)
    if any(mark in model for mark in ("/", "\\", "~")) or model.startswith("."):
        raise UsageError(f"no folder {model!r}")
    known = ", ".join(sorted(REGISTERED))
    raise UsageError(
        f"unknown model type {model!r} and no folder of that name (types with a layout: {known})"
    )


def hf_config(source: ModelSource, overrides: dict):
    """The transformers config the model is built from, with ``overrides`` (each a field it has)."""
    from transformers import AutoConfig

    if source.folder is None:
        fields = AutoConfig.for_model(source.model_type).to_dict()
        config = lambda: tiny_config(source.model_type, **overrides)  # noqa: E731
    else:
        fields = AutoConfig.from_pretrained(source.folder).to_dict()
        config = lambda: AutoConfig.from_pretrained(source.folder, **overrides)  # noqa: E731
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise UsageError(
            f"--set {unknown[0]}=...: the config of {source.describe()} has no field {unknown[0]!r}"
        )
    return config()


def build_model(source: ModelSource, config: CheckConfig):
    """The model, the same on every rank: loaded weights, or random ones drawn from ``config.seed``."""
    dtype, settings = DTYPES[config.dtype], config.settings
    if source.folder is None:
        return tiny_model(
            source.model_type, seed=config.seed, attn_implementation=config.attn, dtype=dtype, **settings
        )
    from transformers import AutoModelForCausalLM

    attn = None if config.attn == "auto" else config.attn  # transformers' own choice: sdpa, else eager
    if source.weights:
        return AutoModelForCausalLM.from_pretrained(
            source.folder, attn_implementation=attn, dtype=dtype, **settings
        )
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        model = causal_lm(hf_config(source, settings), attn_implementation=attn)
    return model.to(dtype)


def _attention(model_config, source: ModelSource, attn: str) -> str:
    """The attention ``--attn`` runs: "auto" is sdpa where the model supports it, else eager; a usage error
    where the model does not support the one asked for (GPT-Neo and MPT have no sdpa)."""
    try:
        with torch.device("meta"):
            causal_lm(model_config, attn_implementation="sdpa" if attn == "auto" else attn)
    except ValueError as error:
        if "does not support an attention implementation" not in str(error):
            raise
        if attn == "auto":
            return "eager"
        others = [other for other in ATTNS if other not in (attn, "auto")]
        raise UsageError(
            f"{source.describe()} does not support --attn {attn}: use --attn {others[0]}"
        ) from None
    return "sdpa" if attn == "auto" else attn


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
    attn = _attention(model_config, source, config.attn)
    how = implementation + (f", Ulysses degree {degree}" if implementation == "hybrid" else "")
    extras = [f"{config.pad} padding" if config.pad else "", "packed documents" if config.packed else ""]
    shape = ", ".join(filter(None, [f"batch {config.batch} x {config.seq} tokens", *extras]))
    return f"{source.describe()}, {config.dtype}, {attn} attention, {shape}; cp={config.cp} ({how})"


# ---------------------------------------------------------------- what each rank runs


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
    return float64_distances(twin, model, params_of(model), batch, mesh, cp_forward, twin_forward)


def _ready() -> bool:
    """A no-op on every rank: it returns once all of them have joined the group."""
    return True


# ---------------------------------------------------------------- what the parent prints


def rounding_names(config: CheckConfig) -> tuple[str, str]:
    """The check's dtype and the wider one its second look runs in, by their short names."""
    dtype = DTYPES[config.dtype]
    return SHORT_NAMES[dtype], SHORT_NAMES[WIDER[dtype]]


def beyond_rounding(
    config: CheckConfig, parities: list[Parity], roundings: list[Rounding] | None
) -> list[str]:
    """The rows that fail on some rank and, where the second look ran (``roundings``), lie beyond the dtype's
    rounding there (:meth:`cpshard.tools.parity.Rounding.beyond`)."""
    failing = failing_rows(parities, config.rtol)
    if roundings is None:
        return failing
    beyond = {row for rounding in roundings for row in rounding.beyond(failing, config.rtol)}
    return [row for row in failing if row in beyond]


def format_report(
    config: CheckConfig, parities: list[Parity], roundings: list[Rounding] | None = None
) -> str:
    """The table (worst difference over the ranks per row) and the verdict naming failing rows; a row that
    fails at the tolerance but lies within the dtype's rounding of a wider run (``roundings``) is marked
    so."""
    lines = [
        f"parity against one process ({config.dtype}; a row passes when max |diff| <= {config.rtol:g} "
        "x scale):"
    ]
    failing, beyond = failing_rows(parities, config.rtol), beyond_rounding(config, parities, roundings)
    rounding = tuple(row for row in failing if row not in beyond)
    narrow, wide = rounding_names(config)
    lines += format_rows(parities, config.rtol, rounding, narrow)
    rows = len(parities[0].diffs)
    if rounding:
        lines.append(
            f"against a run of the same weights and batch in {wide} (largest |diff| / scale, worst rank):"
        )
        for row in rounding:
            cp, own, *arithmetic = (max(sides) for sides in zip(*(r.relative(row) for r in roundings)))
            same = any(r.same_arithmetic(row) for r in roundings) and arithmetic
            tail = f"; cp run in {wide} {arithmetic[0]:.1e} (the same arithmetic)" if same else ""
            lines.append(f"  {row}: cp {cp:.1e}, one process {own:.1e}{tail}")
    if beyond:
        names = ", ".join(beyond)
        lines.append(f"FAIL: {len(beyond)} of {rows} rows differ beyond {config.rtol:g} x scale: {names}")
    elif rounding:
        lines.append(
            f"PASS: {rows} rows on {len(parities)} ranks ({len(rounding)} within {narrow} rounding, as the "
            f"{wide} runs above show)"
        )
    else:
        lines.append(f"PASS: {rows} rows on {len(parities)} ranks")
    return "\n".join(lines)


def exit_status(config: CheckConfig, parities: list[Parity], roundings: list[Rounding] | None = None) -> int:
    """0 when every row passes on every rank (or lies within the dtype's rounding, where ``roundings``
    says), 1 otherwise."""
    return 1 if beyond_rounding(config, parities, roundings) else 0


#: what cpshard raises to refuse a model or an input: its message says it all, without the rank's traceback
REFUSALS = ("LayoutError", "BatchError", "ValueError")


def _reported(error: RankError) -> str:
    """The ranks' failure in one line where every rank refused with cpshard's own error, else with the
    blamed rank's traceback (a crash); one of the model's own forward without cp is named as the model's."""
    kinds = {failure.kind for failure in error.failures.values()}
    if kinds <= set(REFUSALS):
        return str(error).split("\n", 1)[0]
    if kinds == {"OneProcessFailed"}:
        first, _, traceback = str(error).partition("\n")
        return (
            f"{first}\nthat is the model's own forward, in one process without cp: the model does not run as "
            f"it is configured (its dtype, a config field), whatever cp does; where, below:\n{traceback}"
        )
    return str(error)


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
            print(f"cpshard check: {_reported(error)}", file=sys.stderr, flush=True)
            return 1
    out(f"  ran in {time.perf_counter() - start:.1f} s\n")
    out(format_report(config, parities, roundings))
    return exit_status(config, parities, roundings)
