"""Expert parallelism (EP): each rank computes only its own experts, on every token that picked them.

The expert weights are split over the ``ep`` ranks on dim 0: ep rank ``r`` holds experts
``[r*E/ep, (r+1)*E/ep)``. Each rank routes its own tokens with the replicated router (so every
choice is the one a single process makes for that token), sends each (token, k) pair to the rank
that owns its expert (one uneven all-to-all, after the per-expert counts), the owner runs the
model's own experts function on what it received, and a second all-to-all brings the results home,
where the routing weights combine them. No token reaches an expert twice; the backward is the
reverse all-to-alls, so an owner's expert-weight gradients already sum over every token of the ep
group and need no further reduction over ``ep``.

Under tensor parallelism the ``tp`` ranks of a cp slice hold the same tokens, routed alike by the
replicated router; each takes a disjoint share of their (token, k) pairs, so each pair reaches its
expert once. Two plans (:data:`EXPERT_PLANS`):

- "dispatch": each tp rank takes a share of the tokens with all their pairs (:func:`share_rows`) and
  sends it to the owners as above; one all-gather over ``tp`` joins the shares' outputs, whose backward
  is each rank's share of the (replicated) gradient, and the inputs' gradients come back gathered the
  same way: a tp rank moves its share of the tokens, not all of them.
- "all_reduce", for an ep group inside one tp group (its ranks hold the same tokens): each rank runs
  its own experts on the pairs (of its share, :func:`pair_share`, where ep < tp) that picked them, with
  no token exchange at all; one all-reduce over ``tp`` joins the results, and the experts' input and
  routing-weight gradients are summed over ``tp``.

Either way the router and the residual stream stay replicated with whole gradients on every tp rank,
so the MoE block is no tp entry module (:func:`cpshard.parallel.tensor.tensor_parallel_hooks` skips it).

Registered in transformers' experts registry (``ExpertsInterface``) as ``cpshard_ep_<inner>``,
the way :mod:`cpshard.attention.cp_attention` wraps attention: outside a cp call, or when the call has no
expert group, it is the model's own implementation, untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from cpshard.call import current_call
from cpshard.comm.collectives import gather_shares, share_rows, sum_grads_over_group, sum_over_group
from cpshard.comm.exchange import all_to_all, all_to_all_rows
from cpshard.comm.record import serving
from cpshard.interfaces import SeenAs, register_wrapper
from cpshard.layouts.structure import submodule, text_config
from cpshard.parallel.adapters import parameters_below

PREFIX = "cpshard_ep_"
#: how the experts layer runs under ep (see the module docstring); "auto" picks "all_reduce" where it can
EXPERT_PLANS = ("auto", "dispatch", "all_reduce")


def expert_counts(config) -> tuple[int, int]:
    """``(number of experts, experts per token)`` under the names MoE configs use."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return experts, getattr(config, "num_experts_per_tok", None)


@dataclass(frozen=True)
class Routing:
    """Where this rank's (token, k) pairs go: sorted by expert, so each owner's rows are contiguous."""

    #: indices into the flattened ``[tokens * top_k]`` pairs, by expert (stable); sentinel experts last
    order: torch.Tensor
    #: pairs per expert, ``[num_experts]`` (int64): what the owners are told before the rows travel
    per_expert: torch.Tensor
    top_k: int

    @property
    def valid(self) -> int:
        """Pairs that go to a real expert (transformers' EP sentinel ``num_experts`` goes nowhere)."""
        return int(self.per_expert.sum())

    def per_rank(self, ep: int) -> list[int]:
        """Rows sent to each ep rank."""
        return rank_counts(self.per_expert, ep)


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """The routing plan of ``top_k_index`` (``[tokens, top_k]``, the router's choices on this rank)."""
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    per_expert = torch.bincount(flat[flat < num_experts], minlength=num_experts)
    return Routing(order, per_expert, top_k_index.shape[-1])


def rank_counts(per_expert: torch.Tensor, ep: int) -> list[int]:
    """Per-expert counts summed per owner (experts are cut in ``ep`` consecutive blocks)."""
    return per_expert.view(ep, -1).sum(dim=1).tolist()


def local_expert_ids(received_per_expert: torch.Tensor, ep: int) -> torch.Tensor:
    """The local expert of each received row: rows come by source rank, then by expert within it."""
    local = received_per_expert.numel() // ep
    return (
        torch.arange(local, device=received_per_expert.device)
        .repeat(ep)
        .repeat_interleave(received_per_expert)
    )


def exchange_counts(per_expert: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """``[ep * E/ep]``: for each source rank, how many rows it sends to each of this rank's experts."""
    return all_to_all(per_expert, 0, 0, group, name=name)


def gather_pairs(hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The token row of each routed pair, in routing order (a token picked k times is sent k times)."""
    return hidden_states[routing.order[: routing.valid] // routing.top_k]


def compute_local(function, module, rows: torch.Tensor, local_ids: torch.Tensor, local: int) -> torch.Tensor:
    """Each received row through its one local expert with weight 1, by the model's own experts ``function``
    (so the arithmetic is the model's; the routing weights are applied at home, where they live)."""
    ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    out = function(SeenAs(module, num_experts=local), rows, local_ids[:, None], ones)
    if rows.requires_grad and not out.requires_grad:
        # nothing arrived: keep the return all-to-all in the graph, or this rank would skip its backward
        out = out + 0 * rows
    return out


def combine(returned: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``[tokens, hidden]``: each pair's result, back in token order, times its routing weight, summed over k
    (the eager experts' order: product first, then the sum into zeros)."""
    pairs = routing.order.numel()
    padded = torch.cat([returned, returned.new_zeros(pairs - returned.shape[0], returned.shape[1])])
    inverse = torch.empty_like(routing.order)
    inverse[routing.order] = torch.arange(pairs, device=routing.order.device)
    per_pair = padded[inverse].view(-1, routing.top_k, returned.shape[1])
    return (per_pair * top_k_weights[..., None]).sum(dim=1)


def local_count(module) -> int:
    """How many experts this rank's weights hold (dim 0 of the first expert weight)."""
    weight = module.gate_up_proj if getattr(module, "has_gate", True) else module.up_proj
    return weight.shape[0]


def check_block(module, ep: int, name: str) -> None:
    """``module`` holds this rank's block of ``num_experts // ep`` experts; a clear error otherwise."""
    total = module.num_experts
    if total % ep or local_count(module) != total // ep:
        raise ValueError(
            f"{name}: expert parallelism over {ep} ranks needs each rank's block of {total} // {ep} experts; "
            f"got weights for {local_count(module)} experts"
            + (f" ({total} experts do not divide over {ep} ranks)" if total % ep else "")
        )


@serving("ep")
def ep_experts(
    function, module, hidden_states, top_k_index, top_k_weights, group, name: str = "experts"
) -> torch.Tensor:
    """The experts layer under expert parallelism over ``group``; ``module`` holds the local expert block."""
    ep, total = dist.get_world_size(group), module.num_experts
    check_block(module, ep, name)
    routing = route(top_k_index, total)
    received_per_expert = exchange_counts(routing.per_expert, group, name=f"{name} counts")
    send, receive = routing.per_rank(ep), rank_counts(received_per_expert, ep)
    rows = all_to_all_rows(
        gather_pairs(hidden_states, routing), send, receive, group, name=f"{name} dispatch"
    )
    out = compute_local(function, module, rows, local_expert_ids(received_per_expert, ep), total // ep)
    returned = all_to_all_rows(out, receive, send, group, name=f"{name} return")
    return combine(returned, routing, top_k_weights).to(hidden_states.dtype)


def pair_share(top_k_index: torch.Tensor, shares: int, share: int, num_experts: int) -> torch.Tensor:
    """``top_k_index`` with every pair outside share ``share`` of ``shares`` (contiguous runs of the
    flattened pairs) sent nowhere (the sentinel ``num_experts``): ranks holding the same tokens each
    take a disjoint share, and together every pair once."""
    if shares == 1:
        return top_k_index
    pairs = torch.arange(top_k_index.numel(), device=top_k_index.device).view_as(top_k_index)
    return torch.where(pairs * shares // top_k_index.numel() == share, top_k_index, num_experts)


def owned_experts(function, module, hidden_states, top_k_index, top_k_weights, rank: int, ep: int, name: str):
    """``[tokens, hidden]``: the pairs that picked this rank's experts (block ``rank`` of ``ep``), through
    them and combined; the other pairs add zero. No collective: the caller sums over the ranks."""
    check_block(module, ep, name)
    total, local = module.num_experts, module.num_experts // ep
    owned = (top_k_index >= rank * local) & (top_k_index < (rank + 1) * local)
    index = torch.where(owned, top_k_index, total)
    routing = route(index, total)
    local_ids = index.reshape(-1)[routing.order[: routing.valid]] - rank * local
    out = compute_local(function, module, gather_pairs(hidden_states, routing), local_ids, local)
    return combine(out, routing, top_k_weights).to(hidden_states.dtype)


def check_expert_plan(plan: str) -> None:
    """Raise a ValueError naming the plans when ``plan`` is not one of them."""
    if plan not in EXPERT_PLANS:
        raise ValueError(f"expert_plan={plan!r}; choose one of {', '.join(EXPERT_PLANS)}")


def choose_expert_plan(plan: str, tp: int, ep: int) -> str:
    """``plan`` for a mesh of ``tp`` and ``ep``: "auto" is "all_reduce" where the ep group lies inside a tp
    group (ep divides tp: its ranks hold the same tokens), else "dispatch"."""
    check_expert_plan(plan)
    same_tokens = tp > 1 and tp % ep == 0
    if plan == "auto":
        return "all_reduce" if same_tokens else "dispatch"
    if plan == "all_reduce" and ep > 1 and not same_tokens:
        raise ValueError(
            f"expert_plan='all_reduce' runs each rank's experts on the tokens its whole ep group holds, "
            f"but with ep={ep} and tp={tp} the ep group's ranks hold different tokens (only the tp ranks of "
            "a cp slice share them); use an ep that divides tp, or expert_plan='dispatch'"
        )
    return plan


@serving("ep")  # its collectives run over tp groups, but they serve the experts
def tp_experts(call, function, module, hidden_states, top_k_index, top_k_weights, name: str):
    """The experts layer when the ``tp`` ranks hold the same tokens, by the call's plan (see the module
    docstring): each pair runs once, and every tp rank gets the whole output."""
    tp_group, ep_group = call.tp_group, call.expert_group
    if call.expert_plan == "dispatch":
        mine = ep_experts(
            function,
            module,
            share_rows(hidden_states, tp_group, f"{name} tp input"),
            share_rows(top_k_index, tp_group),
            share_rows(top_k_weights, tp_group, f"{name} tp routing weights"),
            ep_group,
            name,
        )
        return gather_shares(mine, hidden_states.shape[0], tp_group, f"{name} tp output")
    tp, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    ep, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    hidden_states = sum_grads_over_group(hidden_states, tp_group, f"{name} tp input")
    top_k_weights = sum_grads_over_group(top_k_weights, tp_group, f"{name} tp routing weights")
    index = pair_share(top_k_index, tp // ep, tp_rank // ep, module.num_experts)  # ep < tp: tp // ep shares
    partial = owned_experts(function, module, hidden_states, index, top_k_weights, ep_rank, ep, name)
    return sum_over_group(partial, tp_group, f"{name} tp sum")


def _inner_function(inner: str, module):
    if inner == "eager":
        return type(module).forward.__wrapped__  # the class's own forward, under transformers' decorator
    return ALL_EXPERTS_FUNCTIONS[inner]


def _ep_function(inner: str):
    def experts(module, hidden_states, top_k_index, top_k_weights):
        function = _inner_function(inner, module)
        call = current_call()
        if call is None or call.expert_group is None:
            return function(module, hidden_states, top_k_index, top_k_weights)
        name = call.name_of(module)
        name = name if "experts" in name else f"{name} experts"
        if call.tp_group is not None:
            return tp_experts(call, function, module, hidden_states, top_k_index, top_k_weights, name)
        return ep_experts(
            function, module, hidden_states, top_k_index, top_k_weights, call.expert_group, name
        )

    experts.__doc__ = f"Expert parallelism around the {inner!r} experts implementation (cpshard)."
    return experts


def experts_name(inner: str | None) -> str:
    """Register EP around ``inner`` (idempotent) and return the registered implementation name."""
    return register_wrapper(ALL_EXPERTS_FUNCTIONS, PREFIX, inner or "eager", _ep_function)


def is_experts(module) -> bool:
    """A transformers experts module dispatched through ``ExpertsInterface``
    (``@use_experts_implementation``)."""
    marks = ("has_gate", "is_transposed", "is_concatenated", "num_experts", "config")
    return hasattr(type(module).forward, "__wrapped__") and all(hasattr(module, mark) for mark in marks)


def experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's experts modules by path."""
    return {path: module for path, module in model.named_modules() if is_experts(module)}


def install_experts(model: torch.nn.Module) -> str:
    """Switch ``model``'s experts to the EP wrapper of its current implementation (idempotent);
    returns its name.

    Outside a cp call with an expert group the model computes exactly as before."""
    modules = experts_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no mixture-of-experts layer dispatched through transformers' "
            "ExpertsInterface (@use_experts_implementation): there are no experts to split over ep; use ep=1"
        )
    first = next(iter(modules.values()))
    name = experts_name(first.config._experts_implementation)
    if first.config._experts_implementation != name:
        model.set_experts_implementation(name)
    missed = [path for path, module in modules.items() if module.config._experts_implementation != name]
    if missed:
        raise ValueError(
            f"could not switch the experts at {', '.join(missed)} to {name!r}; their config kept its own"
        )
    return name


def check_experts(config, ep: int) -> None:
    """Raise a ValueError when ``config``'s MoE cannot run under cp with expert parallelism over
    ``ep`` ranks."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = expert_counts(config)[0]
    if not isinstance(experts, int):
        raise ValueError(
            f"model type {getattr(config, 'model_type', '?')!r} declares no num_experts: "
            f"it has no experts for ep={ep}"
        )
    if experts % ep:
        fitting = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(
            f"expert parallelism splits the {experts} experts over ep={ep} ranks, "
            f"and {ep} does not divide {experts}; "
            f"choose ep among {', '.join(map(str, fitting))}"
        )


def _check_experts_hold_their_weights(model, layout, ep: int) -> None:
    """Each experts module holds its one slice per expert itself: ep splits those weights on dim 0 and
    nothing below them (PEFT's LoRA on the experts wraps them, its adapters beside them, which ep would
    leave whole): a clear error from parallelize and the cp call's checks, where the first forward would
    fail on the experts' count."""
    for i, layer in enumerate(submodule(model, layout.decoder_layers) or ()):
        for path in layout.experts:
            module = submodule(layer, path)
            nested = parameters_below(module) if module is not None else []
            if nested:
                where, kind = f"{layout.decoder_layers}.{i}.{path}", type(module).__name__
                raise ValueError(
                    f"{where} is a {kind} with parameters below it ({', '.join(nested)}; PEFT's LoRA on the "
                    f"experts): ep={ep} splits the experts' own weights alone; build the mesh with ep=1 (cp "
                    "and fsdp serve it), or leave the experts out of the adapter's targets"
                )


def check_expert_parallel(model, layout, ep: int, tp: int = 1) -> None:
    """The layout's experts can serve ``ep`` beside ``tp`` (a model without experts only ep=1); see
    :func:`check_experts` and :func:`_check_experts_hold_their_weights`."""
    config = text_config(model)
    if layout.experts:
        check_experts(config, ep)
        if ep > 1:
            _check_experts_hold_their_weights(model, layout, ep)
        if tp > 1 and ep == 1:
            raise NotImplementedError(
                f"tensor parallelism (tp={tp}) for the mixture-of-experts layout {layout.name!r} needs "
                "expert parallelism: cpshard does not split experts over tp; build the mesh with an ep that "
                f"tp divides or that divides tp (ep={tp}, for one)"
            )
    elif ep > 1:
        experts = expert_counts(config)[0]
        why = (
            f"the model's {experts} experts run whole on every rank (cp serves expert parallelism where a "
            "layout file names the experts, as qwen3_moe's does; a derived layout never does)"
            if experts
            else "there is nothing to split over ep"
        )
        raise ValueError(
            f"ep={ep}, but the layout {layout.name!r} of model type "
            f"{getattr(config, 'model_type', '?')!r} declares no experts: {why}; build the mesh with ep=1"
        )
