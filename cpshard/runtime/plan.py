"""Plan one cp call: every decision of a call in one place, apart from running it.

``plan_call`` turns (model, layout, options, params, batch, mesh) into the :class:`~cpshard.call.CallPlan`
that the installed pieces read and the padded batch the model runs on: the checks of tp, ep and compile
against the mesh, the implementation and its Ulysses degree, the batch checked the same on every rank of
each dp group, the sequence order, the padding, the meshes and groups. Nothing is installed and nothing
runs the model here (:mod:`cpshard.runtime.forward` does); the only collective is the batch check's one
all-gather, so that a bad batch is an error on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from cpshard.attention.choice import IMPLEMENTATIONS, choose_implementation
from cpshard.call import CallPlan
from cpshard.layouts.layout import Layout
from cpshard.layouts.registry import BY_NAME
from cpshard.layouts.structure import text_config
from cpshard.loss.statistics import check_statistics
from cpshard.parallel.experts import check_expert_parallel, check_expert_plan, choose_expert_plan
from cpshard.parallel.mesh import cp_mesh, cp_size, expert_degree, mesh_size, split_cp
from cpshard.parallel.params import check_params_mapping
from cpshard.parallel.placement import expert_mesh
from cpshard.parallel.tensor import check_tensor_parallel
from cpshard.recurrent.slots import RECURRENT_SCHEMES
from cpshard.runtime.batch import (
    PaddedBatch,
    check_batch,
    labels_read_as_shifted,
    packed_documents,
    pad_batch,
)
from cpshard.runtime.compiled import check_compiled_parallelism
from cpshard.spec.sequence import check_order


@dataclass(frozen=True)
class CPOptions:
    """Every option of ``make_cp_forward`` but the layout (each documented there), checked when made."""

    implementation: str = "auto"
    logits: bool = True
    strict: bool = False
    ulysses_degree: int | None = None
    sequence_order: str = "auto"
    token_logprobs: bool = False
    #: names of :data:`cpshard.loss.statistics.STATISTICS`
    token_statistics: tuple[str, ...] = ()
    expert_plan: str = "auto"
    #: False, True (inductor) or a torch.compile backend: each decoder layer's forward compiled
    compile: bool | str = False
    #: memory modes: the MLP a block of this many tokens at a time; each attention checkpointed on its own
    mlp_tile: int | None = None
    attention_recompute: bool = False
    #: Ulysses' attention a block of queries at a time, its scores within this many bytes (None: whole)
    attention_block_bytes: int | None = None
    #: how linear-attention layers run: "auto", "state_passing" or "head_split"
    recurrent: str = "auto"

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation={self.implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}"
            )
        for name in ("logits", "strict", "token_logprobs", "attention_recompute"):
            if not isinstance(getattr(self, name), bool):  # "no" from a config file would read as True
                raise ValueError(f"{name}={getattr(self, name)!r} is not a bool; give True or False")
        if self.ulysses_degree is not None and self.implementation != "hybrid":
            raise ValueError(
                f"ulysses_degree={self.ulysses_degree!r} sets hybrid's Ulysses group size, and "
                f"implementation={self.implementation!r} would ignore it: give implementation='hybrid', or "
                "leave ulysses_degree out"
            )
        if self.sequence_order != "auto":
            check_order(self.sequence_order)
        check_expert_plan(self.expert_plan)
        object.__setattr__(self, "token_statistics", check_statistics(self.token_statistics))  # as a tuple
        check_block_bytes(self.attention_block_bytes, self.compile)
        if self.recurrent not in RECURRENT_SCHEMES:
            raise ValueError(f"recurrent={self.recurrent!r}; choose one of {', '.join(RECURRENT_SCHEMES)}")


def check_block_bytes(block_bytes, compile) -> None:
    """Raise unless ``attention_block_bytes`` is None or a positive int, given without ``compile``."""
    if block_bytes is None:
        return
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"attention_block_bytes={block_bytes!r} is not a positive number of bytes")
    if compile:
        raise ValueError(
            "attention_block_bytes checkpoints blocks of queries inside a layer, which compile=True does "
            "not trace; make the cp forward without one of them"
        )


def choose_strategy(model, layout: Layout, options: CPOptions, mesh, params: dict) -> tuple[str, int]:
    """``(implementation, Ulysses degree)`` for this mesh, after the checks of tp, ep and compile."""
    cp, tp, ep = cp_size(mesh), mesh_size(mesh, "tp"), expert_degree(mesh)
    check_expert_parallel(model, layout, ep, tp)
    if layout.recurrent:  # before tp's: what recurrent layers refuse says more than a module tp would cut
        check_recurrent_parallelism(layout, options, tp, ep)
    if layout.cut_at_entry and (max(tp, ep) > 1 or options.compile):
        # the layers' cut hooks, which resolve a compiled layer's call, are not installed; tp's hooks go on
        # the decoder's list, not on a second stack beside it (HRM's)
        raise ValueError(
            f"tp={tp}, ep={ep}, compile={options.compile!r}: cp serves a decoder cut where the sequence "
            f"enters it ({layout.decoder}) with cp alone (and fsdp), eagerly, yet"
        )
    check_tensor_parallel(model, layout, tp)
    if options.compile:
        check_compiled_parallelism(tp, ep)
    if layout.sparse_attention and (max(tp, ep) > 1 or options.compile):
        raise ValueError(
            f"tp={tp}, ep={ep}, compile={options.compile!r}: cp serves the sparse attention of "
            f"{layout.sparse_attention} (keys gathered whole) with cp alone (and fsdp), eagerly, yet"
        )
    plain = [name for name, value in params.items() if not isinstance(value, DTensor)]
    if plain and (max(tp, ep) > 1 or len(plain) < len(params)):
        where = f"on a mesh with tp={tp} and ep={ep}" if max(tp, ep) > 1 else "beside parallelize's DTensors"
        named = ", ".join(plain[:3]) + ", ..." * (len(plain) > 3)
        some = "" if len(plain) == len(params) else f" (plain: {named})"
        raise ValueError(
            f"{where} cp_forward needs the parameters of cpshard.params_of(cpshard.parallelize(model, mesh))"
            f"{some}: each rank computes with its own blocks of them (parallelize the model after adding any "
            "module, as LoRA's adapters)"
        )
    return implementation_for(text_config(model), layout, options, cp, tp)


def implementation_for(config, layout: Layout, options: CPOptions, cp: int, tp: int) -> tuple[str, int]:
    """``(implementation, Ulysses degree)`` for the heads one tp rank holds
    (:meth:`~cpshard.layouts.layout.Layout.tp_rank_head_counts`) over ``cp`` ranks, or the ValueError
    saying why the options cannot serve them."""
    heads = layout.tp_rank_head_counts(config, tp)[0]
    split = tp > 1 and layout.tp_splits_heads
    if split and options.implementation == "ulysses" and heads % cp:
        raise ValueError(
            f"Ulysses under tp={tp} splits each tp rank's {heads} heads over cp={cp}: "
            "num_attention_heads="
            f"{heads * tp} must divide by tp * cp = {tp * cp}; implementation='ring' or 'hybrid' "
            "serve other sizes"
        )
    try:
        return choose_implementation(options.implementation, heads, cp, options.ulysses_degree)
    except ValueError as error:
        if not split:
            raise
        raise ValueError(f"{error} (under tp={tp}: the {heads} heads each tp rank holds)") from None


def check_recurrent_parallelism(layout: Layout, options: CPOptions, tp: int, ep: int) -> None:
    """What cp does not yet serve beside recurrent layers, refused with the layer's name. Under tp the
    recurrent layers run whole on every tp rank beside the plan's split layers, which a registered layout
    file's plan is tested for; a derived plan is the model's own, written for no such mix."""
    mixer = f"the recurrent layers ({', '.join(sorted({row.module for row in layout.recurrent}))})"
    files = ", ".join(sorted(name for name, file in BY_NAME.items() if file.recurrent))
    refused = {  # what is asked: (whether it is, what to do instead)
        f"tp > 1 with the derived layout {layout.name!r}": (
            tp > 1 and layout.name.startswith("derived:"),
            f"build the mesh with tp=1 (tp beside them: the layout files {files})",
        ),
        "ep > 1": (ep > 1, "build the mesh with ep=1"),
        f"compile={options.compile!r}": (bool(options.compile), "make the cp forward without compile"),
    }
    for what, (asked, instead) in refused.items():
        if asked:
            raise ValueError(f"{what}: cp does not serve {mixer} under it yet; {instead}")
    if options.recurrent == "head_split" and any(row.kernel == "lightning" for row in layout.recurrent):
        raise ValueError(
            "recurrent='head_split': lightning attention runs its block loop inside its module, which cp "
            "serves by state passing only; use recurrent='state_passing' or 'auto'"
        )


def _packed_refusal(layout: Layout) -> str | None:
    """Why a layout with recurrent layers refuses packed documents (None: it takes them)."""
    if not layout.recurrent:
        return None
    mixers = ", ".join(sorted({row.module for row in layout.recurrent}))
    if _convolutions_only(layout):
        return (
            f"packed documents (position_ids that restart): the model's short convolutions ({mixers}) read "
            "the tokens before each one across document boundaries (transformers keeps documents apart "
            "there, where it does at all, only through its GPU kernels' sequence indices); cp refuses rather "
            "than hand a document's tokens into the next one's: pass one document per row"
        )
    return (
        f"packed documents (position_ids that restart): the model's recurrent layers ({mixers}) carry "
        "their state across document boundaries (transformers keeps documents apart there, where it does at "
        "all, only through its GPU kernels' sequence indices: fla's cu_seqlens, mamba_ssm's seq_idx); cp "
        "refuses rather than pass a state from one document into the next: pass one document per row"
    )


def _convolutions_only(layout: Layout) -> bool:
    """Whether the layout's recurrent layers are short convolutions alone (their kernels keep no state)."""
    return bool(layout.recurrent) and all(row.decay == "none" for row in layout.recurrent)


def _contiguous_only(layout: Layout) -> str | None:
    """Why ``layout`` runs in contiguous order only (None: it takes any)."""
    if _convolutions_only(layout):
        return (
            "the model's short convolutions read the tokens just before each rank's slice, a halo handed on "
            "from rank to rank in contiguous order"
        )
    if layout.recurrent:
        return (
            "the model's recurrent layers carry a state along the sequence, passed from rank to rank "
            "in contiguous order"
        )
    if layout.cut_at_entry:
        return (
            f"the sequence is cut into contiguous slices where it enters the decoder ({layout.decoder}), "
            "whose own loop keeps per-position states beside its layers"
        )
    if layout.looped:
        return (
            f"the model enters its layers more than once per forward and runs its final norm "
            f"({layout.final_norm}) between the passes too, where another order would be undone mid-stream"
        )
    return None


def choose_order(
    sequence_order: str, implementation: str, batch: dict, contiguous_only: str | None = None
) -> str:
    """The sequence order: the one asked for, else contiguous for Ulysses (its attention sees whole
    sequences) and for layouts that hold to it (``contiguous_only`` says why: recurrent layers pass their
    state from rank to rank along the sequence), striped for ring and hybrid on packed documents, head-tail
    on whole ones."""
    if contiguous_only and sequence_order not in ("auto", "contiguous"):
        raise ValueError(
            f"sequence_order={sequence_order!r}: {contiguous_only}; pass sequence_order='auto' or "
            "'contiguous'"
        )
    if contiguous_only:
        return "contiguous"
    if sequence_order != "auto":
        if implementation == "ulysses" and sequence_order != "contiguous":
            raise ValueError(
                f"sequence_order={sequence_order!r} balances ring's causal work; Ulysses gathers "
                "whole sequences in the order the ranks hold them and attends under the model's mask "
                "in natural order, so it runs contiguous: pass sequence_order='auto' (or 'contiguous'), "
                "or implementation='ring' or 'hybrid'"
            )
        return sequence_order
    if implementation == "ulysses":
        return "contiguous"
    return "striped" if packed_documents(batch) else "head_tail"


@torch._dynamo.disable  # derives sub-meshes and groups, which a compiled cp_forward cannot trace
def _call_plan(
    layout: Layout,
    options: CPOptions,
    module_names: Mapping[int, str],
    mesh,
    strategy: tuple[str, int, str],
    padded: PaddedBatch,
) -> CallPlan:
    implementation, degree, order = strategy
    cp, tp, ep = cp_size(mesh), mesh_size(mesh, "tp"), expert_degree(mesh)
    return CallPlan(
        mesh=mesh,
        cp_size=cp,
        layout=layout,
        module_names=module_names,
        implementation=implementation,
        ulysses=degree,
        order=order,
        length=padded.length,
        padded_length=padded.padded_length,
        split_mesh=split_cp(mesh, cp // degree, degree) if implementation != "ulysses" else None,
        cp_mesh=cp_mesh(mesh),
        tp_group=mesh.get_group("tp") if tp > 1 else None,
        expert_group=expert_mesh(mesh).get_group("ep") if ep > 1 else None,
        expert_plan=choose_expert_plan(options.expert_plan, tp, ep),
        traced=bool(options.compile),
        mlp_tile=options.mlp_tile,
        attention_recompute=options.attention_recompute,
        attention_block_bytes=options.attention_block_bytes,
        recurrent=options.recurrent,
    )


def check_modules_unchanged(model, module_names: Mapping[int, str]) -> None:
    """Raise where a module of ``model`` was replaced (or added) since its cp forward was made: cpshard set
    the model up then (its hooks, its attention, the layout it verified), and a new module would run
    without them."""
    changed = [name for name, module in model.named_modules() if module_names.get(id(module)) != name]
    if changed:
        raise ValueError(
            f"{type(model).__name__}: {', '.join(changed[:3])} changed after make_cp_forward (a module "
            "replaced or added), which cpshard did not set up: make the cp forward again "
            "(make_cp_forward(model)) after changing the model's modules"
        )


def check_no_autocast(device: str) -> None:
    """Raise where ``torch.autocast`` is on for ``device``: for a caller that wants its step in the weights'
    own dtype. cpshard's calls no longer use it: since turn 20 they serve autocast themselves
    (:mod:`cpshard.precision`)."""
    if torch.is_autocast_enabled(device):
        dtype = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
        raise ValueError(
            f"a cpshard call (cp_forward, cp_prefill or cp_decode) runs under torch.autocast({device!r}, "
            f"dtype=torch.{dtype}), which this caller refuses: cast the model instead "
            f"(model.to(torch.{dtype})) or call it outside autocast"
        )


def parameter_aliases(model) -> list[tuple[str, ...]]:
    """Each parameter's names in ``model``, in order: a tied weight has several, and params may give it
    under any one of them."""
    names = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [tuple(aliases) for aliases in names.values()]


def check_params(model, params: dict) -> None:
    """Raise unless ``params`` is a dict whose every entry names a parameter or buffer of ``model`` of the
    same (global) shape, and that gives every parameter: the forward runs the model's code on them alone,
    and another model's would run without a word, as would the model's own tensor for one left out."""
    check_params_mapping(params, "cp_forward")
    everything = (*model.named_parameters(remove_duplicate=False), *model.named_buffers())
    own = {name: tensor.shape for name, tensor in everything}
    unknown = [name for name in params if name not in own]
    if unknown:
        raise ValueError(
            f"params holds {len(unknown)} entries that are not {type(model).__name__}'s parameters (e.g. "
            f"{unknown[:3]}); pass cpshard.params_of(model) of the model cp_forward was made for"
        )
    missing = [names[0] for names in parameter_aliases(model) if not any(name in params for name in names)]
    if missing:
        raise ValueError(
            f"params lacks {len(missing)} of {type(model).__name__}'s parameters (e.g. {missing[:3]}): "
            "cp_forward runs on params alone, not on what the model holds beside them; pass every parameter "
            "(cpshard.params_of(model), frozen ones too: their requires_grad does not matter)"
        )
    differing = [
        f"{name} {tuple(params[name].shape)} (the model's: {tuple(own[name])})"
        for name in params
        if params[name].shape != own[name]
    ]
    if differing:
        raise ValueError(
            f"params differ in shape from {type(model).__name__}'s: {', '.join(differing[:3])}; pass "
            "cpshard.params_of(model) of the model cp_forward was made for (another model's would run on it "
            "without a word)"
        )


def plan_call(
    model,
    layout: Layout,
    options: CPOptions,
    module_names: Mapping[int, str],
    params: dict,
    batch: dict,
    mesh,
    failed: Exception | None = None,
) -> tuple[CallPlan, PaddedBatch]:
    """How one call splits its work, and the batch padded for it: the batch (checked the same on every rank
    of each dp group, or every rank raises), the strategy (checked against the mesh), the order, the
    padding, the meshes and groups. The model and ``params`` are the caller's to check first (the forward's
    :meth:`~cpshard.runtime.forward.CPForward.check_call`); ``failed``, what those checks raised on this
    rank, the batch check carries to every rank."""
    if layout.labels_shifted:
        batch = labels_read_as_shifted(batch)
    vocab_size = getattr(text_config(model), "vocab_size", None)
    check_batch(batch, mesh, vocab_size, _packed_refusal(layout), layout.whole_inputs, failed)
    implementation, degree = choose_strategy(model, layout, options, mesh, params)
    order = choose_order(options.sequence_order, implementation, batch, _contiguous_only(layout))
    padded = pad_batch(batch, cp_size(mesh), getattr(text_config(model), "pad_token_id", None), order)
    return _call_plan(layout, options, module_names, mesh, (implementation, degree, order), padded), padded
