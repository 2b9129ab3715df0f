"""The loss of one cp call, from this rank's outputs: the loss over the global count of real tokens (each
rank's token-loss sum, summed over the token axes), the labels' log-probabilities and token statistics where
asked for, and the MoE router's load-balancing loss over the whole batch.

Where the call asks for the logits and a loss and cpshard's head gives the model's logits, the loss runs the
head itself (:func:`~cpshard.loss.blocked.logits_and_token_log_probs`: the logits whole, nothing else of
their size kept); with ``logits=False`` it runs the head a block of tokens at a time.
"""

from __future__ import annotations

from functools import partial

import torch

from cpshard.call import CallPlan
from cpshard.layouts.layout import Layout
from cpshard.layouts.structure import text_config
from cpshard.loss.blocked import (
    blocked_loss_sum,
    blocked_token_log_probs,
    blocked_token_statistics,
    logits_and_token_log_probs,
)
from cpshard.loss.cross_entropy import cross_entropy_sum, token_log_probs
from cpshard.loss.head import head_matches, head_of, transform_logits
from cpshard.loss.router import load_balancing_loss
from cpshard.loss.statistics import token_statistics
from cpshard.loss.streams import streams_loss_sum
from cpshard.parallel.experts import expert_counts
from cpshard.parallel.mesh import TOKEN_AXES, cp_rank, group_over, summed_over
from cpshard.runtime.batch import PaddedBatch, local_token_mask
from cpshard.runtime.count import loss_normaliser
from cpshard.runtime.plan import CPOptions


class CallLoss:
    """The losses of one cp forward's calls (its model, layout and options), from each rank's outputs."""

    def __init__(self, model, layout: Layout, options: CPOptions):
        self.model, self.layout, self.options = model, layout, options

    def head_with_loss(self, params: dict, padded: PaddedBatch) -> bool:
        """Whether the loss computes the logits (:func:`~cpshard.loss.blocked.logits_and_token_log_probs`,
        which keeps neither their softmax nor their gradient beside them): where the call asks for the logits
        and a loss, and cpshard's head gives the model's logits (else the model's own head runs)."""
        options = self.options
        return (
            options.logits
            and padded.shift_labels is not None
            and not self.layout.stream_logits  # the model's own head gives every stream's logits
            and head_matches(self.model, params, self.layout.head_transforms, self.layout.decoder)
        )

    def router_loss(self, router_logits: tuple, padded: PaddedBatch, call: CallPlan) -> torch.Tensor:
        """The config's coefficient times the load-balancing loss over the whole batch."""
        rank = cp_rank(call.mesh)
        mask = local_token_mask(padded, call.order, call.cp_size, rank)
        aux = load_balancing_loss(
            router_logits, *expert_counts(text_config(self.model)), mask, group_over(call.mesh, TOKEN_AXES)
        )
        return text_config(self.model).router_aux_loss_coef * aux

    def _head(self, params: dict) -> tuple:
        """``(weight, bias, transform)``: the LM head as the losses without logits apply it."""
        transform = partial(
            transform_logits, config=text_config(self.model), transforms=self.layout.head_transforms
        )
        return *head_of(self.model, params), transform

    def _loss_sum(self, local, params: dict, labels: torch.Tensor) -> torch.Tensor:
        if self.options.logits:
            return cross_entropy_sum(local, labels)
        return blocked_loss_sum(local, labels, *self._head(params))

    def _token_logprobs(self, local, params: dict, labels: torch.Tensor) -> torch.Tensor:
        if self.options.logits:
            return token_log_probs(local, labels)
        return blocked_token_log_probs(local, labels, *self._head(params))

    def _token_statistics(self, local, params: dict, labels: torch.Tensor) -> dict | None:
        names = self.options.token_statistics
        if not names:
            return None
        if self.options.logits:
            return token_statistics(local, labels, names)
        return blocked_token_statistics(local, labels, *self._head(params), names)

    def __call__(
        self,
        local,
        params: dict,
        padded: PaddedBatch,
        mesh,
        held: torch.Tensor,
        reduced: bool,
        head_with_loss: bool = False,
        streams: torch.Tensor | None = None,
    ):
        """``(loss, num_tokens, this rank's token log-probabilities or None, its token statistics or
        None, its logits)``; the loss is the log-probabilities' negated sum over the normaliser when they are
        asked for (one pass over the head); not ``reduced``, this rank's share of it. ``head_with_loss``:
        ``local`` is the final hidden states, and the loss computes the logits. ``streams``: the further
        streams' logits, whose token losses join the loss over every stream's tokens."""
        if padded.shift_labels is None:
            for option in ("token_logprobs", "token_statistics"):
                if getattr(self.options, option):
                    raise ValueError(f"{option} needs labels: give the batch labels or shift_labels")
            return None, torch.zeros((), dtype=torch.int64), None, None, local
        local_labels = padded.shift_labels.index_select(1, held.to(padded.shift_labels.device))
        num_tokens, divisor = loss_normaliser(padded.shift_labels, padded.num_items, mesh)
        if head_with_loss:
            local, picked = logits_and_token_log_probs(local, local_labels, *self._head(params))
            logprobs, loss_sum = picked if self.options.token_logprobs else None, -picked.sum()
        elif self.options.token_logprobs:
            logprobs = self._token_logprobs(local, params, local_labels)
            loss_sum = -logprobs.sum()
        else:
            logprobs, loss_sum = None, self._loss_sum(local, params, local_labels)
        if streams is not None:
            loss_sum = loss_sum + streams_loss_sum(streams, local_labels)
            divisor = divisor * (1 + streams.shape[1])
        loss = loss_sum / divisor
        if reduced:
            loss = summed_over(loss, mesh, TOKEN_AXES, "loss")
        return loss, num_tokens, logprobs, self._token_statistics(local, params, local_labels), local
