"""The analytic communication optimum of a training step: what the byte counts are checked against."""

from __future__ import annotations

from dataclasses import dataclass

from cpshard.attention import kv_replication
from cpshard.batch import padded_length
from cpshard.forward import params_of
from cpshard.layouts import resolve_layout


@dataclass(frozen=True)
class CommOptimum:
    """The bytes one rank must put into collectives for one training step, by purpose."""

    all_to_all: int
    gradients: int
    loss: int

    @property
    def all_reduce(self) -> int:
        return self.gradients + self.loss

    @property
    def total(self) -> int:
        return self.all_to_all + self.all_reduce


def ulysses_optimum(
    *, batch: int, length: int, cp: int, layers: int, heads: int, kv_heads: int, head_dim: int, param_bytes: int,
    itemsize: int = 4,
) -> CommOptimum:
    """Bytes per rank per Ulysses training step on a cp-only mesh (inputs of each collective).

    Per decoder layer, forward and again backward: one all-to-all each of q, k, v and the
    attention output, each of ``B * L/cp * heads * head_dim`` elements (k and v with the kv
    heads after replication). Then one all-reduce of every gradient and one of the fp32 loss.
    """
    if cp == 1:
        return CommOptimum(0, 0, 0)
    tokens = batch * padded_length(length, cp) // cp
    kv = kv_heads * kv_replication(heads, kv_heads, cp)
    per_layer = tokens * head_dim * itemsize * (heads + kv + kv + heads)
    return CommOptimum(all_to_all=2 * layers * per_layer, gradients=param_bytes, loss=4)


def optimum_of(model, batch: int, length: int, cp: int) -> CommOptimum:
    """:func:`ulysses_optimum` with the sizes read off ``model`` and its layout."""
    layout, config = resolve_layout(model), model.config
    heads, kv_heads = getattr(config, layout.heads), getattr(config, layout.kv_heads)
    params = list(params_of(model).values())
    return ulysses_optimum(
        batch=batch,
        length=length,
        cp=cp,
        layers=len(model.get_submodule(layout.decoder_layers)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        itemsize=params[0].element_size(),
    )
