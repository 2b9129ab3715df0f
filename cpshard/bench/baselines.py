"""What ``cpshard bench`` measures cpshard against: one process, and other Ulysses implementations.

- ``single``: the plain model on the whole sequence, on one process (:func:`cpshard.tools.parity.reference`).
- ``dtensor``, ``deepspeed``, ``yunchang``: Ulysses done by DTensor's ``redistribute``, by DeepSpeed's
  ``DistributedAttention`` and by yunchang's ``SeqAllToAll4D``, each run as its users run it
  (:func:`peer_step`): the rank cuts its own slice of the batch (as DeepSpeed's data loader adapter
  does), the plain transformers model runs on it with the peer's attention function registered in
  transformers' registry (causal sdpa on whole sequences, the model's mask dropped, as DeepSpeed's
  ``UlyssesSPAttentionHF`` does), the loss is torch's cross-entropy over the whole batch's label count
  (every rank holds the batch: no collective), and gradients and loss are summed in one all-reduce.
  Nothing of cpshard (cut, batch checks, loss, gradient reduction) is on their path.

Bytes are counted the same way for all: :class:`CollectiveCounter` sees every collective torch
dispatches (functional or c10d) and sums the sizes of the tensors passed in. ALST's exchange is an
operator of DeepSpeed's own whose backward calls the collective beneath the dispatcher: its forward
exchanges (and their recomputation) are counted, its backward ones are not.
"""

from __future__ import annotations

import importlib
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cpshard.interfaces import register_once
from cpshard.loss.cross_entropy import IGNORE_INDEX
from cpshard.tools.parity import reference

#: the Ulysses baselines and the modules each needs (an optional one missing gives a note, not an error)
REQUIRES = {
    "dtensor": (),
    "deepspeed": ("deepspeed", "deepspeed.sequence.layer"),
    "yunchang": ("yunchang.comm.all_to_all",),
    "alst": ("deepspeed", "deepspeed.runtime.sequence_parallel.ulysses_sp"),
}
INSTALL = {
    "deepspeed": "DS_BUILD_OPS=0 pip install deepspeed",
    "alst": "DS_BUILD_OPS=0 pip install 'deepspeed>=0.19'",
    "yunchang": "pip install yunchang",
}

#: per collective op: the argument that holds what this rank sends, and the kind of collective it is
_SENT_ARG = {
    "all_to_all_single": (0, "all_to_all"),
    "alltoall_base_": (1, "all_to_all"),
    "alltoall_": (1, "all_to_all"),
    "all_gather_into_tensor": (0, "all_gather"),
    "all_gather_into_tensor_coalesced": (0, "all_gather"),
    "allgather_": (1, "all_gather"),
    "_allgather_base_": (1, "all_gather"),
    "allgather_into_tensor_coalesced_": (1, "all_gather"),
    "all_reduce": (0, "all_reduce"),
    "all_reduce_coalesced": (0, "all_reduce"),
    "allreduce_": (0, "all_reduce"),
    "allreduce_coalesced_": (0, "all_reduce"),
    "reduce_scatter_tensor": (0, "reduce_scatter"),
    "reduce_scatter_tensor_coalesced": (0, "reduce_scatter"),
    "reduce_scatter_": (1, "reduce_scatter"),
    "_reduce_scatter_base_": (1, "reduce_scatter"),
    "reduce_scatter_tensor_coalesced_": (1, "reduce_scatter"),
    "broadcast": (0, "broadcast"),
    "broadcast_": (0, "broadcast"),
    "send": (0, "send"),
    "dim_zero_all_to_all": (0, "all_to_all"),  # DeepSpeed's ALST exchange, an operator of its own
}
_RECEIVE_ONLY = ("recv_", "recv_any_source_")
_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "deepspeed")


class CollectiveCounter(TorchDispatchMode):
    """Inside the block, the bytes this rank passes into collectives (forward and backward), and receives."""

    def __init__(self):
        super().__init__()
        self.sent: dict[str, int] = defaultdict(int)
        self.received = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace in _NAMESPACES and (name in _SENT_ARG or name in _RECEIVE_ONLY):
            if name in _SENT_ARG:
                index, kind = _SENT_ARG[name]
                self.sent[kind] += _nbytes(args[index])
            if (
                name != "send"
            ):  # c10d ops write into their first argument; functional ones return their output
                self.received += _nbytes(args[0] if func.namespace == "c10d" else result)
        return result

    def summary(self) -> tuple[int, int, dict[str, int]]:
        """Bytes sent, bytes received, bytes sent by op."""
        return sum(self.sent.values()), self.received, dict(self.sent)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


def missing(name: str) -> str | None:
    """Why baseline ``name`` cannot run here (a one-line note), or None when it can."""
    for module in REQUIRES[name]:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - an optional package may fail to import in any way
            return (
                f"{name} baseline skipped: import {module} failed ({type(error).__name__}: {error}); "
                f"try {INSTALL[name]}"
            )
    return None


def plain_step(model):
    """One process, no cp: the loss and gradients of the plain model on the whole sequence."""

    def step(params: dict, batch: dict, mesh):
        return reference(model, params, batch)

    return step


# ---------------------------------------------------------------- the peers, as their users run them


def shard_batch(batch: dict, rank: int, size: int) -> dict:
    """This rank's contiguous share of a whole-sequence batch, as DeepSpeed's ``UlyssesSPDataLoaderAdapter``
    cuts it: labels shifted over the whole row first, positions counted over the whole row."""
    if set(batch) - {"input_ids", "labels"}:
        raise ValueError(
            f"the peers take input_ids and labels alone, not {sorted(set(batch) - {'input_ids', 'labels'})}"
        )
    ids = batch["input_ids"]
    length = ids.shape[1]
    if length % size:
        raise ValueError(
            f"the peers cut L={length} into {size} equal slices: give a length divisible by {size}"
        )
    share = slice(rank * length // size, (rank + 1) * length // size)
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    positions = torch.arange(length).expand_as(ids)
    return dict(input_ids=ids[:, share], position_ids=positions[:, share], shift_labels=labels[:, share])


def label_count(batch: dict) -> torch.Tensor:
    """The loss's divisor: the label tokens of the whole batch, which every rank holds (no collective)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torch's cross-entropy on this rank's logits, as the peers' users compute it."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def all_reduced(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """``tensors`` summed over ``group`` in one all-reduce of one flat buffer (a data-parallel bucket)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def peer_step(name: str, model):
    """``step(params, batch, mesh) -> (loss, grads)`` of peer ``name`` on ``model`` (its own copy: its
    attention function is swapped), run as its users run it: each rank cuts its own share of the batch,
    runs the plain model on it with the peer's attention, computes torch's cross-entropy over the whole
    batch's label count, and all-reduces its gradients and its loss together. Nothing of cpshard runs on
    this path."""
    if name == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    model.set_attn_implementation(registered(name))

    def step(params: dict, batch: dict, mesh):
        group = mesh.get_group("cp")
        local = shard_batch(batch, dist.get_rank(group), dist.get_world_size(group))
        leaves = {n: value.detach().requires_grad_(True) for n, value in params.items()}
        inputs = dict(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
        logits = torch.func.functional_call(model, leaves, (), {**inputs, "peer_mesh": mesh["cp"]}).logits
        loss = cross_entropy_sum(logits, local["shift_labels"]) / label_count(batch)
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves.values(), grads)]
        *grads, loss = all_reduced([*grads, loss.detach()], group)
        return loss, dict(zip(leaves, grads))

    return step


def _dtensor_exchange(x: torch.Tensor, mesh, src: int, dst: int) -> torch.Tensor:
    """``x`` split on dim ``src`` over ``mesh``, split on dim ``dst`` instead, by DTensor's redistribute."""
    return (
        DTensor.from_local(x, mesh, [Shard(src)], run_check=False).redistribute(mesh, [Shard(dst)]).to_local()
    )


def _causal(module, query, key, value):
    """Causal attention on whole sequences, ``b h s d`` in, ``b s h d`` out (key/value heads grouped)."""
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=module.scaling, enable_gqa=True
    )
    return out.transpose(1, 2)


def _dtensor(module, query, key, value, mesh):
    query, key, value = (
        _dtensor_exchange(x, mesh, 2, 1) for x in (query, key, value)
    )  # b h s@cp d -> b h@cp s d
    return _dtensor_exchange(_causal(module, query, key, value), mesh, 2, 1)  # b s h@cp d -> b s@cp h d


def _yunchang(module, query, key, value, mesh):
    from yunchang.comm.all_to_all import SeqAllToAll4D

    group = mesh.get_group()
    # yunchang's layout is b s h d: scatter heads (2), gather the sequence (1); and back
    query, key, value = (
        SeqAllToAll4D.apply(group, x.transpose(1, 2), 2, 1).transpose(1, 2) for x in (query, key, value)
    )
    return SeqAllToAll4D.apply(group, _causal(module, query, key, value), 1, 2)


def _deepspeed(module, query, key, value, mesh):
    from deepspeed.sequence.layer import DistributedAttention

    def local_attention(query, key, value):  # b s h@cp d, whole sequences
        return _causal(module, *(x.transpose(1, 2) for x in (query, key, value)))

    attention = DistributedAttention(local_attention, mesh.get_group(), scatter_idx=2, gather_idx=1)
    return attention(*(x.transpose(1, 2) for x in (query, key, value)), 0)  # batch_dim_idx 0: b s h d


_EXCHANGES = {"dtensor": _dtensor, "deepspeed": _deepspeed, "yunchang": _yunchang}


def _attention(exchange):
    """The peer's attention: the model's mask dropped (causal on whole sequences, as DeepSpeed's
    ``UlyssesSPAttentionHF`` does), key/value heads fewer than the ranks repeated until each rank has one."""

    def attention(module, query, key, value, attention_mask, peer_mesh, **kwargs):
        size, kv_heads = peer_mesh.size(), key.shape[1]
        if kv_heads % size:
            if size % kv_heads:
                raise ValueError(
                    f"the peers split {kv_heads} key/value heads over {size} ranks: one must divide the other"
                )
            key, value = (x.repeat_interleave(size // kv_heads, dim=1) for x in (key, value))
        return exchange(module, query, key, value, peer_mesh), None

    return attention


def registered(name: str) -> str:
    """Register peer ``name``'s attention (idempotent); the implementation name to give the model."""
    implementation = register_once(
        ALL_ATTENTION_FUNCTIONS, f"cpshard_bench_{name}", lambda: _attention(_EXCHANGES[name])
    )
    return register_once(
        ALL_MASK_ATTENTION_FUNCTIONS, implementation, lambda: ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    )


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
