"""The loss without the logits: the LM head and cross-entropy, chunk by chunk of tokens.

Each chunk's logits are computed, consumed and dropped, forward and (recomputed under
checkpointing) backward, so a rank never holds its whole ``[L/cp, vocab]`` logits. The head
is the model's own weights, with the model's own logit transforms (Gemma's final softcap,
Granite's scaling) read from its config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cpshard.cross_entropy import cross_entropy_sum

#: logits per chunk: 2^24 fp32 values (64 MiB) at most, whatever the vocabulary
CHUNK_ELEMENTS = 1 << 24


def transform_logits(logits: torch.Tensor, config) -> torch.Tensor:
    """What the model's LM head does after the projection (Granite's scaling, Gemma's softcap)."""
    scaling = getattr(config, "logits_scaling", None)
    if scaling:
        logits = logits / scaling
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _chunk_loss(hidden, labels, weight, bias, config):
    return cross_entropy_sum(transform_logits(F.linear(hidden, weight, bias), config), labels)


def tiled_loss_sum(hidden, labels, weight, bias, config, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Summed cross-entropy of ``hidden`` ``[B, S, D]`` against ``labels`` ``[B, S]``, chunk by chunk."""
    step = max(1, chunk_elements // (hidden.shape[0] * weight.shape[0]))
    total = hidden[:, :0].sum(dtype=torch.float32)  # zero, yet in the graph on a rank that holds no token
    for start in range(0, hidden.shape[1], step):
        part = slice(start, start + step)
        total = total + checkpoint(_chunk_loss, hidden[:, part], labels[:, part], weight, bias, config, use_reentrant=False)
    return total


def head_of(model, params: dict):
    """The LM head's weight and bias among ``params`` (a tied weight under the name params has for it)."""
    head = model.get_output_embeddings()
    canonical = {id(p): name for name, p in model.named_parameters()}
    names = {local: canonical[id(p)] for local, p in head.named_parameters()}
    return params[names["weight"]], params[names["bias"]] if "bias" in names else None
