"""The router's load-balancing (aux) loss of mixture-of-experts models, over the whole batch under cp.

transformers adds ``router_aux_loss_coef * E * sum_e(share of picks of e) * (mean router probability
of e)`` to the loss when ``config.output_router_logits`` is set, in the models whose forward computes it
(Mixtral, Qwen3-MoE, ...; DeepSeek-V3 and Llama 4 return their router logits and add nothing): a product
of means over all tokens,
so no rank can compute it from its slice. Each rank sums its own picks, probabilities and tokens;
one all-reduce of ``2E + 1`` floats over the ranks holding other tokens gives every rank the whole
batch's sums (the backward of that sum is the identity: each rank's router logits get their own
gradient, which ``value_and_grad`` then sums like every other).
"""

from __future__ import annotations

import functools
import inspect

import torch

from cpshard.comm.collectives import sum_over_group


def adds_router_loss(model, config) -> bool:
    """Whether ``model``'s own forward adds the load-balancing loss to its loss: ``config`` (its text
    config) asks for router logits, has the coefficient, and the forward computes the loss from them."""
    if not getattr(config, "output_router_logits", False) or not hasattr(config, "router_aux_loss_coef"):
        return False
    return _forward_computes_it(type(model))


@functools.cache
def _forward_computes_it(model_class: type) -> bool:
    """Whether the class's forward calls the load-balancing loss (read from its source once: a call asks
    twice a step)."""
    return "load_balancing_loss_func" in inspect.getsource(model_class.forward)


def load_balancing_loss(
    gate_logits, num_experts: int, top_k: int, token_mask: torch.Tensor, group
) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over the tokens of every rank of ``group``, from this
    rank's.

    ``gate_logits``: one ``[tokens, E]`` tensor per MoE layer, this rank's tokens in ``token_mask``'s
    order."""
    device = gate_logits[0].device
    mask = token_mask.reshape(-1).to(device)
    picks = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    for logits in gate_logits:
        weights = torch.softmax(logits, dim=-1)
        selected = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        picks = picks + torch.zeros_like(picks).scatter_add_(0, selected, mask.repeat_interleave(top_k))
        probs = probs + (weights.float() * mask[:, None]).sum(dim=0)
    sums = torch.cat([picks, probs, (mask.sum() * len(gate_logits))[None]])
    if group is not None:
        sums = sum_over_group(sums, group, name="router aux loss")
    picks, probs, rows = sums.split([num_experts, num_experts, 1])
    return (picks / rows * probs / rows).sum() * num_experts
