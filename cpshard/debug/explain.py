"""``explain``: the layout as it applies to one model on one mesh, before anything runs.

What ``make_cp_forward`` would choose (layout, implementation, kv-head replication) and why; then
each cut and each attention move with its specs, the collective :func:`cpshard.comm.redistribute.plan`
picks and its bytes per token. Reads the model's config and dtype only, so a meta model will do.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpshard.attention.ulysses import kv_replication
from cpshard.debug.analytic import (
    Step,
    attention_paths,
    attention_steps,
    collectives,
    cut_steps,
    mesh_sizes,
)
from cpshard.debug.table import grouped, table
from cpshard.debug.typeof import dtype_name
from cpshard.layouts.layout import Layout
from cpshard.layouts.registry import REGISTERED, resolve_layout
from cpshard.layouts.structure import text_config
from cpshard.parallel.mesh import cp_size
from cpshard.parallel.tensor import check_tensor_parallel
from cpshard.runtime.plan import CPOptions, implementation_for


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found; ``str()`` gives the text."""

    model: str
    layout: Layout
    layout_reason: str
    implementation: str
    implementation_reason: str
    kv_replication: int | None
    sizes: dict
    dtype: str
    cuts: tuple[Step, ...]
    #: the moves of each attention module (empty unless the choice is Ulysses)
    attention: tuple[Step, ...]
    attention_modules: tuple[str, ...]
    #: where the layout's layers run over a sequence of their own (sized by a sub-config: BLT's global
    #: transformer over patches), what the rows below describe
    own_sequence: str = ""

    @property
    def attention_bytes_per_token(self) -> int:
        """Collective input bytes per token a rank holds, over every attention module, forward only."""
        return sum(s.bytes_per_token or 0 for s in self.attention) * len(self.attention_modules)

    def __str__(self) -> str:
        mesh = " ".join(f"{axis}={size}" for axis, size in self.sizes.items())
        lines = [
            f"{self.model} on mesh {mesh}, {self.dtype}",
            table(
                [
                    ("layout", f"{self.layout.name}: {self.layout_reason}"),
                    ("implementation", f"{self.implementation}: {self.implementation_reason}"),
                    *([("kv heads", _kv_text(self.kv_replication))] if self.kv_replication else []),
                ]
            ),
            "",
            "bytes/token: a collective's input on one rank, per token that rank holds (B*L/cp of them)",
            *([self.own_sequence] if self.own_sequence else []),
        ]
        layers, first = self.layout.decoder_layers, f"{self.layout.decoder_layers}.0"
        rows = [_row(f"{first} (once)", self.cuts[0])]
        rows += [_row(f"{layers}.* (each)", s) for s in self.cuts[1:]]
        where = f"{_paths(self.attention_modules, self.layout)} (each)"
        rows += [_row(where, s) for s in self.attention]
        header = ("where", "tensor", "spec in", "spec out", "collective", "bytes/token")
        lines.append(table(rows, header, right=frozenset({5})))
        if self.attention:
            count = collectives(self.attention)
            per_module = sum(s.bytes_per_token or 0 for s in self.attention)
            lines += [
                "",
                f"per attention module: {count} collectives (q, k and v in one), {grouped(per_module)} "
                "bytes/token forward, "
                "the same backward",
                f"over {len(self.attention_modules)} modules: "
                f"{grouped(self.attention_bytes_per_token)} bytes/token forward, "
                f"{grouped(2 * self.attention_bytes_per_token)} forward and backward",
            ]
        return "\n".join(lines)


def _row(where: str, s: Step) -> tuple:
    cost = "?" if s.bytes_per_token is None else grouped(s.bytes_per_token)
    return (where, s.tensor, str(s.src), str(s.dst), s.describe(), cost)


def _kv_text(replicas: int) -> str:
    return (
        "each kv head held once"
        if replicas == 1
        else f"each kv head repeated {replicas}x so that cp divides them"
    )


def _paths(paths: tuple[str, ...], layout: Layout) -> str:
    """``model.layers.{0..31}.self_attn`` when the paths are every layer in order."""
    if paths and list(paths) == [
        f"{layout.decoder_layers}.{i}.{layout.attention}" for i in range(len(paths))
    ]:
        return f"{layout.decoder_layers}.{{0..{len(paths) - 1}}}.{layout.attention}"
    return ", ".join(paths) or "no attention modules"


def _layout_reason(model, layout, chosen: Layout) -> str:
    model_type = getattr(model.config, "model_type", "?")
    if isinstance(layout, Layout):
        return "given as a Layout"
    if layout != "auto":
        return f"named {layout!r}"
    if REGISTERED.get(model_type) is chosen:
        return f"registered for model type {model_type!r} (cpshard/layouts/)"
    return (
        f"no layout file is registered for {model_type!r}; derived from the model's structure "
        "(verified against one process on a probe batch at the first call)"
    )


def _implementation(
    config, layout: Layout, cp: int, tp: int, options: CPOptions
) -> tuple[str, str, int | None]:
    """What ``make_cp_forward`` with ``options`` runs on ``cp`` ranks (over the heads each tp rank holds),
    why, and (for Ulysses) how often each kv head is repeated."""
    heads, kv_heads = layout.tp_rank_head_counts(config, tp)
    whole = tp == 1 or not layout.tp_splits_heads
    held = f"{layout.heads}={heads}" if whole else f"the {heads} heads each tp rank holds (tp={tp})"
    divides, does_not = ("divides over", "is not divisible by") if whole else ("divide over", "do not divide")
    requested = options.implementation
    try:
        name, degree = implementation_for(config, layout, options, cp, tp)
    except ValueError as error:
        return "none", f"cp_forward would raise at its first call: {error}", None
    if name == "ulysses":
        replicas = kv_replication(heads, kv_heads, cp)
        reason = f"{held} {divides} cp={cp}, so each rank attends whole sequences over {heads // cp} heads"
        return (
            name,
            ("auto picks Ulysses where cp divides the heads; " if requested == "auto" else "") + reason,
            replicas,
        )
    how = (
        f"Ulysses over groups of {degree} ranks, a ring of {cp // degree} groups"
        if name == "hybrid"
        else f"k and v travel a ring of {cp} ranks"
    )
    why = f"{held} {does_not} cp={cp}; " if requested == "auto" else ""
    return (
        name,
        f"{why}{how}, sequence in head-tail order (per-tensor costs below are shown for Ulysses only)",
        None,
    )


def explain(model, mesh, *, layout="auto", implementation="auto", ulysses_degree=None) -> Explanation:
    """The layout as applied to ``model`` on ``mesh``: choices, reasons, and every move's collective
    and cost."""
    cp = cp_size(mesh)  # what is no mesh, or has no cp axis, raises here as cp_forward says it
    options = CPOptions(implementation=implementation, ulysses_degree=ulysses_degree)  # as make_cp_forward
    chosen = resolve_layout(model, layout)
    config, sizes = text_config(model), mesh_sizes(mesh)
    check_tensor_parallel(model, chosen, sizes.get("tp", 1))  # a tp that does not divide: cp_forward's error
    name, reason, replicas = _implementation(config, chosen, cp, sizes.get("tp", 1), options)
    attention = attention_steps(config, chosen, sizes, model.dtype) if replicas else ()
    return Explanation(
        f"{type(model).__name__} (model type {getattr(config, 'model_type', '?')!r})",
        chosen,
        _layout_reason(model, layout, chosen),
        name,
        reason,
        replicas,
        sizes,
        dtype_name(model.dtype),
        cut_steps(config, chosen, sizes, model.dtype),
        attention,
        tuple(attention_paths(model, chosen)),
        _own_sequence(chosen),
    )


def _own_sequence(layout: Layout) -> str:
    """What the rows describe where the layout's layers are sized by a sub-config of their own (BLT's global
    transformer), which runs over a sequence of its own that the decoder cuts at its entry; else empty."""
    if not layout.sizes_path:
        return ""
    return (
        f"the rows are {layout.decoder_layers}' (sized by the config's "
        f"{layout.sizes_path}), per position of the sequence they run over; {layout.decoder} "
        "cuts that and its other stacks' sequences at its entry (see its layout file), not listed here"
    )
