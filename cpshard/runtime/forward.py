"""``make_cp_forward``: the model run with its sequence split over the mesh's ``cp`` dimension.

Outside: parameters, whole batches and global results. Inside: each rank's slice and explicit
collectives. Setup (the attention function, the cut hooks) happens once per model; each call
is pure: its result depends on ``(params, batch, mesh)`` alone and nothing is left changed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import ExplicitRedistributionContext

from cpshard.attention.cp_attention import kv_replication, ulysses_name
from cpshard.call import CPCall, running
from cpshard.comm.collectives import sum_over_group
from cpshard.layouts.layout import Layout
from cpshard.layouts.registry import resolve_layout
from cpshard.loss.cross_entropy import IGNORE_INDEX, cross_entropy_sum
from cpshard.loss.head import head_matches, head_of, own_logits, transform_logits
from cpshard.loss.router import load_balancing_loss
from cpshard.loss.tiled import tiled_loss_sum
from cpshard.parallel.experts import check_expert_parallel, expert_counts, install_experts
from cpshard.parallel.fsdp import gather_params
from cpshard.parallel.mesh import TOKEN_DIMS, cp_size, expert_degree, group_over, mesh_size, split_cp
from cpshard.parallel.placement import expert_mesh
from cpshard.parallel.tensor import check_tensor_parallel, install_tensor_parallel
from cpshard.runtime.batch import PaddedBatch, check_batch, local_token_mask, pad_batch
from cpshard.runtime.cut import install_cut
from cpshard.runtime.probe import verify_once
from cpshard.runtime.recompute import recompute_in
from cpshard.spec.sequence import chunk_positions, chunks_per_rank

IMPLEMENTATIONS = ("auto", "ulysses", "ring", "hybrid")
#: models already prepared, and the decoder-layer paths hooked in each (a registry of setup done)
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class CPOutput:
    """The result of one cp call: the global loss, the sequence-sharded logits, the tokens counted."""

    loss: torch.Tensor | None
    logits: DTensor | None
    num_tokens: torch.Tensor


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as a flat ``{name: tensor}`` dict (tied weights once)."""
    return dict(model.named_parameters())


def _prepare(model: torch.nn.Module, layout: Layout) -> None:
    """Install cp attention and the cut hooks once per model (and per decoder-layer path)."""
    hooked = _PREPARED.setdefault(model, set())
    if layout.decoder_layers in hooked:
        return
    model.set_attn_implementation(ulysses_name(model.config._attn_implementation))
    layers = model.get_submodule(layout.decoder_layers)
    install_cut(layers, model.get_submodule(layout.final_norm))
    install_tensor_parallel(layers, layout)
    if layout.experts:
        install_experts(model)
    hooked.add(layout.decoder_layers)


def _proper_divisors(n: int) -> list[int]:
    return [d for d in range(2, n) if n % d == 0]


def choose_implementation(
    requested: str, heads: int, cp: int, ulysses_degree: int | None = None
) -> tuple[str, int]:
    """``(implementation, Ulysses degree)`` for ``heads`` attention heads over ``cp`` ranks.

    auto: Ulysses where cp divides the heads; else hybrid with the largest Ulysses degree that
    divides both; else ring, which has no constraint on heads."""
    if cp == 1 or requested == "ulysses":
        kv_replication(heads, heads, cp)
        return "ulysses", cp
    if requested == "ring":
        return "ring", 1
    fitting = [d for d in _proper_divisors(cp) if heads % d == 0]
    if requested == "hybrid":
        degree = ulysses_degree if ulysses_degree is not None else max(fitting, default=None)
        if degree not in fitting:
            raise ValueError(
                f"hybrid needs a Ulysses degree that divides cp={cp} and num_attention_heads={heads}, "
                f"and is neither 1 nor cp; {'got ' + str(degree) + '; ' if degree else ''}"
                f"degrees that work: {', '.join(map(str, fitting)) or 'none (use ring)'}"
            )
        return "hybrid", degree
    if heads % cp == 0:
        return "ulysses", cp
    return ("hybrid", max(fitting)) if fitting else ("ring", 1)


class CPForward:
    """A cp forward for one model: call it as ``cp_forward(params, batch, mesh)``."""

    def __init__(self, model, layout: Layout, implementation: str, logits: bool, strict: bool, options: dict):
        self.model, self.layout, self.implementation = model, layout, implementation
        self.keep_logits, self.strict = logits, strict
        self.ulysses_degree, self.sequence_order = options["ulysses_degree"], options["sequence_order"]
        self.module_names = {id(module): name for name, module in model.named_modules()}
        self.decoder_prefix = self.module_names[id(model.get_decoder())]
        _prepare(model, layout)

    def _plan(self, mesh, cp: int, params: dict) -> dict:
        """How this call splits the work: implementation, Ulysses degree, sequence order, meshes, groups."""
        tp, ep = mesh_size(mesh, "tp"), expert_degree(mesh)
        check_tensor_parallel(self.model.config, self.layout, tp)
        check_expert_parallel(self.model.config, self.layout, ep)
        if max(tp, ep) > 1 and not any(isinstance(value, DTensor) for value in params.values()):
            raise ValueError(
                f"on a mesh with tp={tp} and ep={ep} cp_forward needs the parameters of "
                "cpshard.params_of(cpshard.parallelize(model, mesh)): each rank computes with its own tp and ep blocks"
            )
        heads = self.layout.head_counts(self.model.config)[0] // tp  # the heads this tp rank holds
        if tp > 1 and self.implementation == "ulysses" and heads % cp:
            raise ValueError(
                f"Ulysses under tp={tp} splits each tp rank's {heads} heads over cp={cp}: num_attention_heads="
                f"{heads * tp} must divide by tp * cp = {tp * cp}; implementation='ring' or 'hybrid' serve other sizes"
            )
        try:
            implementation, degree = choose_implementation(
                self.implementation, heads, cp, self.ulysses_degree
            )
        except ValueError as error:
            if tp == 1:
                raise
            raise ValueError(f"{error} (under tp={tp}: the {heads} heads each tp rank holds)") from None
        order = self.sequence_order
        if order == "auto":
            order = "contiguous" if implementation == "ulysses" else "head_tail"
        chunks_per_rank(order)
        split = split_cp(mesh, cp // degree, degree) if implementation != "ulysses" else None
        groups = dict(
            tp_group=mesh.get_group("tp") if tp > 1 else None,
            expert_group=expert_mesh(mesh).get_group("ep") if ep > 1 else None,
        )
        return dict(implementation=implementation, ulysses=degree, order=order, split_mesh=split, **groups)

    def __call__(self, params: dict, batch: dict, mesh) -> CPOutput:
        verify_once(self, params, mesh)  # a layout that is not a tested file: probed once per model
        cp = cp_size(mesh)
        plan = self._plan(mesh, cp, params)
        check_batch(
            batch, mesh, getattr(self.model.config, "vocab_size", None)
        )  # valid and the same across each cp group, or every rank raises
        multiple = cp * chunks_per_rank(plan["order"])
        padded = pad_batch(batch, multiple, getattr(self.model.config, "pad_token_id", None))
        call = CPCall(
            mesh,
            cp,
            self.layout,
            padded.length,
            self.module_names,
            padded_length=padded.padded_length,
            **plan,
        )
        params = gather_params(
            params, mesh, self.layout
        )  # DTensor parameters (cpshard.parallelize) made whole
        with (
            running(call),
            recompute_in(call, self.model),
            ExplicitRedistributionContext(enable=self.strict, strict=True),
        ):
            local, router_logits = self._local_outputs(params, padded.model_inputs)
        held = chunk_positions(padded.length, cp, mesh.get_local_rank("cp") if cp > 1 else 0)
        local = local[:, : len(held)]  # contiguous order: drop the cp padding at the end
        loss, num_tokens = self._loss(local, params, padded, mesh, held)
        if loss is not None and router_logits:
            loss = loss + self._router_loss(router_logits, padded, call)
        return CPOutput(loss, self._logits(local, padded, mesh), num_tokens)

    def _local_outputs(self, params: dict, inputs: dict) -> tuple[torch.Tensor, tuple | None]:
        """This rank's logits (with ``logits=False`` its final hidden states: the head runs in chunks), and
        its MoE router logits where the config asks for the load-balancing loss (else None).

        Such models run their decoder alone and the head here: the model's own forward would add the
        load-balancing loss of this rank's slice, against the mask of the whole sequence."""
        inputs = {**inputs, "use_cache": False}
        routed = bool(getattr(self.model.config, "output_router_logits", False))
        if self.keep_logits and not routed:
            return torch.func.functional_call(
                self.model, params, (), inputs, strict=False, tie_weights=True
            ).logits, None
        if not head_matches(self.model, params, self.layout.head_transforms):
            why, instead = (
                ("for the router loss (output_router_logits=True)", "without the router loss")
                if routed
                else ("to compute the loss chunk by chunk (logits=False)", "with logits=True")
            )
            raise ValueError(
                f"{type(self.model).__name__}'s LM head gives other logits than its projection with the transforms cpshard "
                f"knows (logits_scaling, final_logit_softcapping), and cpshard would run the head itself {why}; "
                f"{instead}, cp_forward uses the model's own head"
            )
        prefix = self.decoder_prefix + "."
        trunk = {name[len(prefix) :]: value for name, value in params.items() if name.startswith(prefix)}
        output = torch.func.functional_call(
            self.model.get_decoder(), trunk, (), inputs, strict=False, tie_weights=True
        )
        local = output.last_hidden_state
        if self.keep_logits:
            local = own_logits(self.model, params, local, self.layout.head_transforms)
        return local, output.router_logits if routed else None

    def _router_loss(self, router_logits: tuple, padded: PaddedBatch, call: CPCall) -> torch.Tensor:
        """The config's coefficient times the load-balancing loss over the whole batch."""
        rank = call.mesh.get_local_rank("cp") if call.cp_size > 1 else 0
        mask = local_token_mask(padded, call.order, call.cp_size, rank)
        aux = load_balancing_loss(
            router_logits, *expert_counts(self.model.config), mask, group_over(call.mesh, TOKEN_DIMS)
        )
        return self.model.config.router_aux_loss_coef * aux

    def _loss_sum(self, local, params: dict, labels: torch.Tensor) -> torch.Tensor:
        if self.keep_logits:
            return cross_entropy_sum(local, labels)
        transform = partial(
            transform_logits, config=self.model.config, transforms=self.layout.head_transforms
        )
        return tiled_loss_sum(local, labels, *head_of(self.model, params), transform)

    def _loss(self, local, params: dict, padded: PaddedBatch, mesh, held: torch.Tensor):
        if padded.shift_labels is None:
            return None, torch.zeros((), dtype=torch.int64)
        local_labels = padded.shift_labels.index_select(1, held)
        num_tokens = (padded.shift_labels != IGNORE_INDEX).sum()
        batch_group = group_over(mesh, tuple(d for d in TOKEN_DIMS if d != "cp"))
        if batch_group is not None:
            num_tokens = sum_over_group(num_tokens, batch_group, name="token count")
        loss = self._loss_sum(local, params, local_labels) / num_tokens.clamp(min=1)
        token_group = group_over(mesh, TOKEN_DIMS)
        if token_group is not None:
            loss = sum_over_group(loss, token_group, name="loss")
        return loss, num_tokens

    def _logits(self, local_logits, padded: PaddedBatch, mesh) -> DTensor | None:
        if not self.keep_logits:
            return None
        batch, _, vocab = local_logits.shape
        shape = torch.Size((batch, padded.length, vocab))
        stride = (padded.length * vocab, vocab, 1)
        return DTensor.from_local(
            local_logits, mesh["cp"], [Shard(1)], run_check=False, shape=shape, stride=stride
        )


def make_cp_forward(
    model,
    *,
    layout="auto",
    implementation="auto",
    logits=True,
    strict=False,
    ulysses_degree=None,
    sequence_order="auto",
) -> CPForward:
    """Prepare ``model`` once and return its pure ``cp_forward(params, batch, mesh)``.

    ``ulysses_degree``: for hybrid, the Ulysses group size (default: the largest that fits).
    ``sequence_order``: "contiguous" or "head_tail" (causal load balance); "auto" takes head_tail
    for ring and hybrid, contiguous for Ulysses (whose attention sees whole sequences anyway)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    if sequence_order != "auto":
        chunks_per_rank(sequence_order)
    options = dict(ulysses_degree=ulysses_degree, sequence_order=sequence_order)
    return CPForward(model, resolve_layout(model, layout), implementation, logits, strict, options)
