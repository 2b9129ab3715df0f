"""``make_cp_forward``: the model run with its sequence split over the mesh's ``cp`` dimension.

Outside: parameters, whole batches and global results. Inside: each rank's slice and explicit
collectives. Setup (the attention function, the cut hooks) happens once per model; each call
is pure: its result depends on ``(params, batch, mesh)`` alone and nothing is left changed.

The stops a batch makes, most of them inside the model's own forward, where no call chain shows them:

1. plan (:func:`cpshard.runtime.plan.plan_call`): the strategy checked against the mesh, the batch
   checked the same on every rank (:mod:`cpshard.runtime.batch`), labels shifted, padded to a multiple
   of cp with positions for every token, and a :class:`~cpshard.call.CallPlan` that the hooks below read;
2. run: the plan made ambient (:func:`running_call`), the model's own forward called with ``params``;
3. the model's own embeddings, rotary and mask, for the whole sequence;
4. the cut pre-hook on each decoder layer (:mod:`cpshard.runtime.cut`): the hidden states and the
   per-position inputs sliced to this rank's positions;
5. the attention wrapper (:mod:`cpshard.attention.cp_attention`, registered in transformers' attention
   registry): Ulysses' all-to-alls or the ring around the model's own attention function;
6. the final-norm hook (:mod:`cpshard.runtime.cut`): the rows back to contiguous chunks (from head-tail
   or striped order), so the logits are a plain ``Shard(1)``;
7. the head hook: the LM head takes this rank's rows only (where the decoder restored the input's
   length, as GPT-2's does); where there are labels and cpshard's head gives the model's logits, the loss
   runs the head itself (with the logits: whole, nothing else of their size kept; with ``logits=False``: a
   block at a time);
8. the loss (:mod:`cpshard.runtime.call_loss`): a local token-loss sum, summed over the token axes, over
   the global count of real tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import ExplicitRedistributionContext

from cpshard.call import CallPlan, running
from cpshard.comm.consensus import items_text
from cpshard.comm.record import note_call
from cpshard.layouts.layout import Layout
from cpshard.layouts.registry import resolve_layout
from cpshard.layouts.structure import text_config
from cpshard.loss.head import head_matches, own_logits
from cpshard.loss.router import adds_router_loss
from cpshard.loss.streams import check_stream_options, stream_logits
from cpshard.parallel.fsdp import gather_params
from cpshard.parallel.mesh import cp_rank, cp_size, mesh_size
from cpshard.runtime.agreement import check_agreement, config_text
from cpshard.runtime.call_loss import CallLoss
from cpshard.runtime.compiled import compile_layers, compile_options
from cpshard.runtime.cut import held_rows_only
from cpshard.runtime.grad import inputs_summed_in_backward, summed_in_backward
from cpshard.runtime.install import ensure_installed, install
from cpshard.runtime.plan import (
    CPOptions,
    check_modules_unchanged,
    check_params,
    choose_strategy,
    parameter_aliases,
    plan_call,
)
from cpshard.runtime.probe import probe_pending, verify_once
from cpshard.runtime.recompute import recompute_in
from cpshard.runtime.tiled_mlp import check_mlp_tile
from cpshard.runtime.tokens import sequence_sharded
from cpshard.spec.sequence import chunk_positions
from cpshard.streams import rank_stream


@dataclass(frozen=True)
class CPOutput:
    """The result of one cp call: the global loss, the sequence-sharded logits, the tokens counted, and the
    sequence-sharded log-probabilities of the labels when asked for."""

    loss: torch.Tensor | None
    logits: DTensor | None
    num_tokens: torch.Tensor
    #: ``[B, L]``, sharded like the logits: log p(label) per token, 0 where ignored (``token_logprobs=True``)
    token_logprobs: DTensor | None = None
    #: ``{name: [B, L]}``, sharded like the logits, without gradient: the ``token_statistics`` asked for
    token_statistics: dict[str, DTensor] | None = None


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as a flat ``{name: tensor}`` dict (tied weights once): the tensors of this
    moment; a weight replaced in the model later is not in it (take the dict again)."""
    return dict(model.named_parameters())


@contextmanager
def running_call(model, call: CallPlan, inputs: dict, strict: bool = False):
    """The model's own forward (or its decoder's) runs inside this, on ``inputs``: the call is ambient for
    the installed pieces, a layer recomputed under checkpointing re-enters it, ``strict`` raises on implicit
    redistributions, and an open recording learns of the call (:func:`~cpshard.comm.record.note_call`)."""
    note_call(call, model, inputs)
    with (
        running(call),
        recompute_in(model),
        ExplicitRedistributionContext(enable=strict, strict=True),
    ):
        yield


class CPForward:
    """A cp forward for one model: call it as ``cp_forward(params, batch, mesh)``. Setup here (install,
    compile); each call checks its inputs, plans (:func:`cpshard.runtime.plan.plan_call`), runs the plan, and
    takes its loss (:class:`~cpshard.runtime.call_loss.CallLoss`)."""

    def __init__(self, model, layout: Layout, options: CPOptions):
        self.model, self.layout, self.options = model, layout, options
        check_stream_options(layout, options.logits, options.token_logprobs, options.token_statistics)
        check_mlp_tile(model.get_submodule(layout.decoder_layers), layout, options.mlp_tile)
        install(model, layout, options.mlp_tile is not None, options.attention_recompute)
        if options.compile:
            compile_layers(model.get_submodule(layout.decoder_layers), compile_options(options.compile))
        #: the model's modules as set up (each call checks that none was replaced since)
        self.module_names = {id(module): name for name, module in model.named_modules()}
        #: whether the ranks agreed on this cp forward and its first weights (its first call checks)
        self.agreed = False
        self.loss = CallLoss(model, layout, options)

    def __call__(self, params: dict, batch: dict, mesh) -> CPOutput:
        return self._run(params, batch, mesh, reduced=True)

    def folds_reductions(self, params: dict) -> bool:
        """Whether :func:`cpshard.value_and_grad` may sum the loss with the gradients, in one all-reduce
        after the backward (:meth:`unreduced`): for plain parameters (DTensors reduce in their gather's
        backward) and without the router loss (the same on every rank, not a share)."""
        routed = adds_router_loss(self.model, text_config(self.model))
        return not routed and not any(isinstance(value, DTensor) for value in params.values())

    def unreduced(self, params: dict, batch: dict, mesh) -> CPOutput:
        """This rank's share of the loss and of its gradients: summed over the ranks that hold other
        tokens, they are the call's (:func:`cpshard.value_and_grad` sums them in one all-reduce)."""
        if not self.folds_reductions(params):
            raise ValueError("unreduced: parameters are DTensors or the router loss is on; call cp_forward")
        return self._run(params, batch, mesh, reduced=False)

    def _prepare(self, params: dict, batch: dict, mesh, reduced: bool):
        """This call's checks and, for a layout that is not a tested file, its probe until one passes
        (:meth:`check_call`), the plan of this call, the model's install checked again, and the parameters
        as the run takes them: ``reduced``, their gradients summed over the ranks that hold other tokens and
        DTensors made whole."""
        failed = self.check_call(params, mesh)
        plan_inputs = (self.model, self.layout, self.options, self.module_names)
        call, padded = plan_call(*plan_inputs, params, batch, mesh, failed)
        ensure_installed(self.model, self.layout, mesh_size(mesh, "tp"))
        padded = replace(padded, model_inputs=inputs_summed_in_backward(padded.model_inputs, mesh))
        if reduced:
            params = gather_params(summed_in_backward(params, mesh), mesh, self.layout)
        return call, padded, params

    def check_call(self, params: dict, mesh) -> Exception | None:
        """The model's modules as set up and ``params`` its own, on this rank (every call: what differs there
        says more than that the weights differ); on the first call, every rank made this cp forward alike and
        holds the same plain weights (:mod:`cpshard.runtime.agreement`), and every rank raises where one
        failed; then what the mesh and options refuse (:func:`~cpshard.runtime.plan.choose_strategy`, alike
        on every rank), then the layout's probe (:func:`~cpshard.runtime.probe.verify_once`). Until a probe
        has passed, every call is a first call (one retried after a failed probe agrees again: a rank whose
        checks fail must not probe alone). On a later call, what failed on this rank, which the call's batch
        check carries to every rank (:func:`~cpshard.runtime.plan.plan_call`'s ``failed``): no rank waits
        for this one."""
        cp_size(mesh)  # what is no mesh, or has no cp axis, raises here (alike on every rank)
        try:
            check_modules_unchanged(self.model, self.module_names)
            check_params(self.model, params)
            failed = None
        except (TypeError, ValueError) as raised:
            failed = raised
        if not self.agreed or probe_pending(self, mesh):  # every rank raises where one failed: none waits
            description = items_text({"layout": self.layout.name, **vars(self.options)})
            aliases, config = parameter_aliases(self.model), config_text(self.model.config)
            check_agreement(description, aliases, params, mesh, failed, config)
            self.agreed = True  # before the probe, whose own cp call must not agree again
            # what the mesh and options refuse is refused before the probe's work (compiling, under compile)
            choose_strategy(self.model, self.layout, self.options, mesh, params)
            verify_once(self, params, mesh)
            return None
        return failed

    def _run(self, params: dict, batch: dict, mesh, reduced: bool) -> CPOutput:
        call, padded, params = self._prepare(params, batch, mesh, reduced)
        cp, head_with_loss = call.cp_size, self.loss.head_with_loss(params, padded)
        with (
            rank_stream(self.model, cp_rank(mesh), cp),
            running_call(self.model, call, padded.model_inputs, self.options.strict),
        ):
            local, router_logits, streams = self._local_outputs(params, padded.model_inputs, head_with_loss)
        held = chunk_positions(padded.length, cp, cp_rank(mesh))
        local = local[:, : len(held)]  # contiguous order: drop the cp padding at the end
        streams = None if streams is None else streams[:, :, : len(held)]
        loss, num_tokens, logprobs, statistics, local = self.loss(
            local, params, padded, mesh, held, reduced, head_with_loss, streams
        )
        if loss is not None and router_logits:
            loss = loss + self.loss.router_loss(router_logits, padded, call)
        logits = sequence_sharded(local, padded.length, call.cp_mesh) if self.options.logits else None
        logprobs = None if logprobs is None else sequence_sharded(logprobs, padded.length, call.cp_mesh)
        if statistics is not None:
            placed = partial(sequence_sharded, length=padded.length, cp=call.cp_mesh)
            statistics = {name: placed(value) for name, value in statistics.items()}
        return CPOutput(loss, logits, num_tokens, logprobs, statistics)

    def _local_outputs(
        self, params: dict, inputs: dict, head_with_loss: bool = False
    ) -> tuple[torch.Tensor, tuple | None, torch.Tensor | None]:
        """This rank's logits (with ``logits=False`` or ``head_with_loss`` its final hidden states: the head
        runs with the loss, a block at a time), its MoE router logits where the config asks for the
        load-balancing loss (else None), and the logits of the further streams whose losses count (else None:
        :func:`~cpshard.loss.streams.stream_logits`).

        Such models run their decoder alone and the head here: the model's own forward would add the
        load-balancing loss of this rank's slice, against the mask of the whole sequence."""
        inputs = {**inputs, "use_cache": False}
        routed = adds_router_loss(self.model, text_config(self.model))
        if self.options.logits and not routed and not head_with_loss:
            output = torch.func.functional_call(
                self.model, params, (), inputs, strict=False, tie_weights=True
            )
            return output.logits, None, stream_logits(output, self.layout, text_config(self.model))
        if not head_matches(self.model, params, self.layout.head_transforms, self.layout.decoder):
            why, instead = (
                ("for the router loss (output_router_logits=True)", "without the router loss")
                if routed
                else ("to compute the loss a block at a time (logits=False)", "with logits=True")
            )
            raise ValueError(
                f"{type(self.model).__name__}'s LM head gives other logits than its projection with "
                "the transforms cpshard "
                "knows (logits_scaling, final_logit_softcapping), and cpshard would run the head "
                f"itself {why}; "
                f"{instead}, cp_forward uses the model's own head"
            )
        prefix = self.layout.decoder + "."
        trunk = {name[len(prefix) :]: value for name, value in params.items() if name.startswith(prefix)}
        output = torch.func.functional_call(
            self.model.get_submodule(self.layout.decoder), trunk, (), inputs, strict=False, tie_weights=True
        )
        local = held_rows_only(output.last_hidden_state)
        if self.options.logits and not head_with_loss:
            local = own_logits(self.model, params, local, self.layout.head_transforms)
        return local, output.router_logits if routed else None, None


def make_cp_forward(
    model,
    *,
    layout="auto",
    implementation="auto",
    logits=True,
    strict=False,
    ulysses_degree=None,
    sequence_order="auto",
    token_logprobs=False,
    token_statistics=(),
    expert_plan="auto",
    compile=False,
    mlp_tile=None,
    attention_recompute=False,
    attention_block_bytes=None,
    recurrent="auto",
) -> CPForward:
    """Prepare ``model`` once and return its pure ``cp_forward(params, batch, mesh)``.

    ``layout``: "auto" (the file registered for the model's type, else one derived from the model and
    probed once against one process), a registered name, or a :class:`~cpshard.layouts.layout.Layout`.
    ``implementation``: "ulysses", "ring", "hybrid" or "auto" (Ulysses where the heads allow it).
    ``logits``: False computes the loss a block of tokens at a time, never holding a rank's whole
    ``[L/cp, vocab]`` logits (``CPOutput.logits`` is then None); True keeps nothing of the logits' size
    beside them for the loss's backward (it computes each block's softmax again).
    ``strict``: True raises on any implicit DTensor redistribution inside the call.
    ``ulysses_degree``: for hybrid, the Ulysses group size (default: the largest that fits).
    ``sequence_order``: "contiguous", "head_tail" (causal load balance) or "striped" (the causal load
    balance of packed documents: stripes of up to 128 tokens dealt round-robin); "auto" takes contiguous
    for Ulysses (whose attention sees whole sequences anyway), and for ring and hybrid striped where some
    row packs documents (its position_ids restart), else head_tail.
    ``token_logprobs``: also give ``CPOutput.token_logprobs``, the log-probability of each label (a block
    of rows at a time; with ``logits=False`` a block of tokens at a time, never the whole logits).
    ``token_statistics``: names of per-token statistics of the next-token distribution to give in
    ``CPOutput.token_statistics`` (fp32, no gradient, for metrics): "entropy", "top1" (the label is the
    argmax), "mean_logit", "log_sum_sq_probs" (``log sum_v p_v^2``); a block of rows at a time, and with
    ``logits=False`` one more pass of the head a block of tokens at a time.
    ``expert_plan``: how MoE experts run beside tp, "dispatch" (each tp rank sends its share of the
    (token, expert) pairs to the owners) or "all_reduce" (for an ep group inside a tp group: each rank
    runs its own experts, no token exchange); "auto" takes "all_reduce" wherever it applies.
    ``compile``: True compiles each decoder layer's forward with ``torch.compile`` (inductor), as
    large-scale training does; a backend (``"aot_eager"``, or a callable) compiles with that backend.
    The cut and the checks stay eager around the layers; inside a layer nothing breaks the graph, and
    one graph serves every layer (lengths that change make it dynamic after one recompile). cp and data
    parallelism only (tp and ep read the running call, which compiled code cannot).
    ``mlp_tile``: a number of tokens: each decoder layer's MLP (the layout's ``mlp``, dense) runs a block of
    that many tokens at a time under activation checkpointing, so one block's intermediate activations
    live instead of the whole slice's (ALST's TiledMLP); exact, since a dense MLP works token by token.
    ``attention_recompute``: each layer's attention module runs under a checkpoint of its own, inside the
    layer's: its activations (the exchanged q, k, v, its output) are recomputed when the backward reaches
    it, so the MLP's backward does not hold them; one more attention forward and its exchanges per layer.
    ``attention_block_bytes``: a number of bytes: Ulysses runs the model's attention function (sdpa or eager)
    on blocks of queries of the whole sequence, each block's scores (batch x heads x queries x keys x the
    element size) within that many bytes, each under a checkpoint of its own: autograd keeps the exchanged
    q, k and v and nothing of a block (no scores, no float mask, not the function's output), and the
    backward recomputes one block at a time; exact, since the softmax is per query row. sdpa without a
    mask holds no scores and runs as one block. One more attention forward per layer; ring and hybrid,
    which hold one block of keys at a time already, are left as they are; not with ``compile``.
    These are memory modes of a call, not facts of an architecture: a layout says where the MLP is.
    ``recurrent``: how the layout's linear-attention layers run, "state_passing" (each rank's slice from a
    zero state, one fixed-size fp32 summary per rank gathered over cp: bytes independent of L),
    "head_split" (their kernel's inputs exchanged from sequence-split to head-split, the kernel on whole
    sequences for a share of the heads, and back: bytes grow with L; cp must divide their heads) or
    "auto": per layer and call, the one with fewer analytic bytes (state passing where heads do not
    divide)."""
    options = CPOptions(
        implementation,
        logits,
        strict,
        ulysses_degree,
        sequence_order,
        token_logprobs,
        token_statistics,
        expert_plan,
        compile,
        mlp_tile,
        attention_recompute,
        attention_block_bytes,
        recurrent,
    )
    return CPForward(model, resolve_layout(model, layout), options)
