"""``make_cp_forward``: the model run with its sequence split over the mesh's ``cp`` dimension.

Outside: parameters, whole batches and global results. Inside: each rank's slice and explicit
collectives. Setup (the attention function, the cut hooks) happens once per model; each call
is pure: its result depends on ``(params, batch, mesh)`` alone and nothing is left changed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import ExplicitRedistributionContext

from cpshard.attention import kv_replication, ulysses_name
from cpshard.batch import IGNORE_INDEX, PaddedBatch, check_same_batch, pad_batch, validate
from cpshard.collectives import sum_over_group
from cpshard.context import CPCall, running
from cpshard.cut import install_cut
from cpshard.layout import Layout
from cpshard.layouts import resolve_layout
from cpshard.mesh import TOKEN_DIMS, cp_size, group_over

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
    """Install Ulysses attention and the cut hooks once per model (and per decoder-layer path)."""
    hooked = _PREPARED.setdefault(model, set())
    if layout.decoder_layers in hooked:
        return
    model.set_attn_implementation(ulysses_name(model.config._attn_implementation))
    install_cut(model.get_submodule(layout.decoder_layers))
    hooked.add(layout.decoder_layers)


def token_loss_sum(local_logits: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of this rank's tokens, in fp32 as transformers computes it."""
    return F.cross_entropy(
        local_logits.float().flatten(0, 1), local_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def real_tokens_on(rank: int, width: int, length: int) -> int:
    """How many of rank ``rank``'s ``width`` tokens are real (the padding sits at the end)."""
    return max(0, min(width, length - rank * width))


class CPForward:
    """A cp forward for one model: call it as ``cp_forward(params, batch, mesh)``."""

    def __init__(self, model, layout: Layout, implementation: str, logits: bool, strict: bool):
        self.model, self.layout, self.implementation = model, layout, implementation
        self.keep_logits, self.strict = logits, strict
        self.module_names = {id(module): name for name, module in model.named_modules()}
        _prepare(model, layout)

    def _check_heads(self, cp: int) -> None:
        config = self.model.config
        kv_replication(getattr(config, self.layout.heads), getattr(config, self.layout.kv_heads), cp)

    def __call__(self, params: dict, batch: dict, mesh) -> CPOutput:
        cp = cp_size(mesh)
        self._check_heads(cp)
        if cp > 1:
            check_same_batch(batch, mesh.get_group("cp"))
        validate(batch)
        padded = pad_batch(batch, cp, getattr(self.model.config, "pad_token_id", None))
        call = CPCall(mesh, cp, self.layout, padded.length, self.module_names)
        with running(call), ExplicitRedistributionContext(enable=self.strict, strict=True):
            output = torch.func.functional_call(
                self.model, params, (), {**padded.model_inputs, "use_cache": False}, strict=False, tie_weights=True
            )
        local_logits = output.logits
        rank = mesh.get_local_rank("cp") if cp > 1 else 0
        loss, num_tokens = self._loss(local_logits, padded, mesh, rank)
        return CPOutput(loss, self._logits(local_logits, padded, mesh, rank), num_tokens)

    def _loss(self, local_logits, padded: PaddedBatch, mesh, rank: int):
        if padded.shift_labels is None:
            return None, torch.zeros((), dtype=torch.int64)
        width = local_logits.shape[1]
        local_labels = padded.shift_labels.narrow(1, rank * width, width)
        num_tokens = (padded.shift_labels != IGNORE_INDEX).sum()
        batch_group = group_over(mesh, tuple(d for d in TOKEN_DIMS if d != "cp"))
        if batch_group is not None:
            num_tokens = sum_over_group(num_tokens, batch_group, name="token count")
        loss = token_loss_sum(local_logits, local_labels) / num_tokens.clamp(min=1)
        token_group = group_over(mesh, TOKEN_DIMS)
        if token_group is not None:
            loss = sum_over_group(loss, token_group, name="loss")
        return loss, num_tokens

    def _logits(self, local_logits, padded: PaddedBatch, mesh, rank: int) -> DTensor | None:
        if not self.keep_logits:
            return None
        batch, width, vocab = local_logits.shape
        local = local_logits[:, : real_tokens_on(rank, width, padded.length)]
        shape = torch.Size((batch, padded.length, vocab))
        stride = (padded.length * vocab, vocab, 1)
        return DTensor.from_local(local, mesh["cp"], [Shard(1)], run_check=False, shape=shape, stride=stride)


def make_cp_forward(model, *, layout="auto", implementation="auto", logits=True, strict=False) -> CPForward:
    """Prepare ``model`` once and return its pure ``cp_forward(params, batch, mesh)``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    if implementation in ("ring", "hybrid"):
        raise NotImplementedError(f"implementation={implementation!r} is not available yet; use 'ulysses'")
    if not logits:
        raise NotImplementedError("logits=False (the sequence-tiled loss) is not available yet")
    return CPForward(model, resolve_layout(model, layout), implementation, logits, strict)
