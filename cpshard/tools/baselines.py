"""What ``cpshard bench`` measures cpshard against: one process, and other Ulysses implementations.

- ``single``: the plain model on the whole sequence, on one process (:func:`cpshard.tools.parity.reference`).
- ``dtensor``, ``deepspeed``, ``yunchang``: Ulysses done by DTensor's ``redistribute``, by DeepSpeed's
  ``DistributedAttention`` and by yunchang's ``SeqAllToAll4D``. Each is an attention function
  registered in transformers' registry around the same sdpa function; the rest of the model is
  split by cpshard's own machinery (the same cut and gradient all-reduce), so a baseline differs
  from cpshard's Ulysses in the attention's sequence/head exchange and in its loss: torch's
  cross-entropy, as the peers' users compute it, where cpshard's own makes one buffer of the logits'
  size instead of three.

Bytes are counted the same way for all: :class:`CollectiveCounter` sees every collective torch
dispatches (functional or c10d) and sums the sizes of the tensors passed in.
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
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from cpshard.attention.cp_attention import _AsSeenByRank, kv_replication, without_padding_keys
from cpshard.call import active_call
from cpshard.layouts.registry import resolve_layout
from cpshard.loss.cross_entropy import IGNORE_INDEX
from cpshard.runtime.forward import CPForward
from cpshard.runtime.grad import value_and_grad
from cpshard.tools.parity import reference

#: the Ulysses baselines and the modules each needs (an optional one missing gives a note, not an error)
REQUIRES = {
    "dtensor": (),
    "deepspeed": ("deepspeed", "deepspeed.sequence.layer"),
    "yunchang": ("yunchang.comm.all_to_all",),
}
INSTALL = {"deepspeed": "DS_BUILD_OPS=0 pip install deepspeed", "yunchang": "pip install yunchang"}

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
}
_RECEIVE_ONLY = ("recv_", "recv_any_source_")
_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


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
            return f"{name} baseline skipped: import {module} failed ({type(error).__name__}: {error}); try {INSTALL[name]}"
    return None


def plain_step(model):
    """One process, no cp: the loss and gradients of the plain model on the whole sequence."""

    def step(params: dict, batch: dict, mesh):
        return reference(model, params, batch)

    return step


# ---------------------------------------------------------------- the sequence/head exchanges


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _dtensor_exchange(x: torch.Tensor, mesh, src: int, dst: int) -> torch.Tensor:
    """``x`` split on dim ``src`` over ``mesh``, split on dim ``dst`` instead, by DTensor's redistribute."""
    return (
        DTensor.from_local(x, mesh, [Shard(src)], run_check=False).redistribute(mesh, [Shard(dst)]).to_local()
    )


def _dtensor(module, query, key, value, attention_mask, call, **kwargs):
    mesh = call.mesh["cp"]
    query, key, value = (
        _dtensor_exchange(x, mesh, 2, 1) for x in (query, key, value)
    )  # b h s@cp d -> b h@cp s d
    key, value, attention_mask = _drop_padding(key, value, attention_mask, call)
    output, weights = _sdpa(module, query, key, value, attention_mask, **kwargs)
    return _dtensor_exchange(output, mesh, 2, 1), weights  # b s h@cp d -> b s@cp h d


def _yunchang(module, query, key, value, attention_mask, call, **kwargs):
    from yunchang.comm.all_to_all import SeqAllToAll4D

    group = call.mesh.get_group("cp")
    # yunchang's layout is b s h d: scatter heads (2), gather the sequence (1); and back
    query, key, value = (
        SeqAllToAll4D.apply(group, x.transpose(1, 2), 2, 1).transpose(1, 2) for x in (query, key, value)
    )
    key, value, attention_mask = _drop_padding(key, value, attention_mask, call)
    output, weights = _sdpa(module, query, key, value, attention_mask, **kwargs)
    return SeqAllToAll4D.apply(group, output, 1, 2), weights


def _deepspeed(module, query, key, value, attention_mask, call, **kwargs):
    from deepspeed.sequence.layer import DistributedAttention

    def local_attention(query, key, value):  # b s h@cp d, whole sequences; sdpa wants b h s d
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        k, v, mask = _drop_padding(k, v, attention_mask, call)
        return _sdpa(module, q, k, v, mask, **kwargs)[0]  # b s h@cp d, as DeepSpeed gathers it back

    attention = DistributedAttention(local_attention, call.mesh.get_group("cp"), scatter_idx=2, gather_idx=1)
    return attention(*(x.transpose(1, 2) for x in (query, key, value)), 0), None  # batch_dim_idx 0: b s h d


def _drop_padding(key, value, attention_mask, call):
    """As cpshard's Ulysses: keys past the real length (cp padding) are dropped with a tensor mask."""
    if isinstance(attention_mask, torch.Tensor):
        return without_padding_keys(key, value, attention_mask, call.length)
    return key, value, attention_mask


_EXCHANGES = {"dtensor": _dtensor, "deepspeed": _deepspeed, "yunchang": _yunchang}


def _attention(exchange):
    """sdpa, with the baseline's exchange around it inside a cp call (kv heads replicated as cpshard does)."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        call = active_call()
        if call is None:
            return _sdpa(module, query, key, value, attention_mask, **kwargs)
        replicas = kv_replication(query.shape[1], key.shape[1], call.cp_size)
        if replicas > 1:
            key, value = key.repeat_interleave(replicas, dim=1), value.repeat_interleave(replicas, dim=1)
            module = _AsSeenByRank(module, query.shape[1] // key.shape[1], {})
        return exchange(module, query, key, value, attention_mask, call, **kwargs)

    return attention


def registered(name: str) -> str:
    """Register baseline ``name``'s attention (idempotent); the implementation name to give the model."""
    implementation = f"cpshard_bench_{name}"
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(implementation, _attention(_EXCHANGES[name]))
        AttentionMaskInterface.register(implementation, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return implementation


def baseline_step(name: str, model):
    """``step(params, batch, mesh)`` of baseline ``name`` on ``model`` (its own copy: its attention changes).

    cpshard's Ulysses forward cuts the sequence, computes the loss and all-reduces the gradients;
    the baseline's attention function replaces cpshard's."""
    if name == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    cp_forward = TorchLossForward(model)  # installs the cut, then we swap attention
    model.set_attn_implementation(registered(name))
    return value_and_grad(cp_forward)


class TorchLossForward(CPForward):
    """cpshard's Ulysses forward with the loss the peers' users compute: torch's cross-entropy on the local
    logits (cpshard's own makes one buffer of the logits' size instead of three; a peer would not have it)."""

    def __init__(self, model):
        options = dict(ulysses_degree=None, sequence_order="auto")
        super().__init__(model, resolve_layout(model), "ulysses", logits=True, strict=False, options=options)

    def _loss_sum(self, local, params: dict, labels: torch.Tensor) -> torch.Tensor:
        logits, labels = local.float().flatten(0, 1), labels.flatten()
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
