"""The loss of a causal LM that predicts from more than one stream (ProphetNet: its logits are the first
predict stream's, ``logits_ngram`` the others'): every counted stream's token losses against the same labels,
over every stream's tokens, as the model's own loss averages them (the layout's ``stream_logits``)."""

from __future__ import annotations

import torch

from cpshard.layouts.layout import Layout
from cpshard.loss.cross_entropy import cross_entropy_sum


def check_stream_options(layout: Layout, logits: bool, token_logprobs: bool, token_statistics) -> None:
    """Raise, at setup, for what a call cannot give where the loss is more than one stream's: the loss without
    logits runs the head on the decoder's last hidden states (ProphetNet's are the main stream's, not the
    predict streams the logits come from), and per-token results would be the first stream's alone."""
    if layout.stream_logits is None:
        return
    asked = {
        "logits=False": not logits,
        "token_logprobs=True": token_logprobs,
        "token_statistics": bool(token_statistics),
    }
    refused = [what for what, given in asked.items() if given]
    if refused:
        raise ValueError(
            f"layout {layout.name!r}: {', '.join(refused)}: its loss is every prediction stream's "
            f"({layout.stream_logits} beside the logits), which cp computes from the model's own logits "
            "only; make the cp forward with logits=True and without per-token results"
        )


def stream_logits(output, layout: Layout, config) -> torch.Tensor | None:
    """``[B, n, L, V]``: the logits of the further streams whose losses count, from the model's ``output``;
    None where the layout names none, or the config turns their loss off (ProphetNet's
    ``disable_ngram_loss``: the first stream's alone)."""
    if layout.stream_logits is None or getattr(config, "disable_ngram_loss", False):
        return None
    return getattr(output, layout.stream_logits)


def streams_loss_sum(streams: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of every stream of ``streams`` ``[B, n, L, V]`` against ``labels`` ``[B, L]``
    (each stream the same labels, as the model's loss takes them)."""
    return cross_entropy_sum(streams, labels.unsqueeze(1).expand(-1, streams.shape[1], -1))
