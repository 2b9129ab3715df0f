"""The ALST peer of ``cpshard bench``: DeepSpeed's Arctic Long Sequence Training stack, set up as its
documentation says, on the ranks' own (gloo) process group.

DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``: ``UlyssesSPAttentionHF`` (registered with
``register_with_transformers``, position ids gathered in every layer), ``TiledMLP`` (the MLP run a tile
of rows at a time and recomputed in the backward, tiles as its example picks them), ``TiledFusedLogitsLoss``
(the LM head and loss a tile at a time, gradients taken in the forward), the model's activation
checkpointing, and the loss of its documentation (each rank's mean, weighted by the token counts of
a differentiable all-gather). Gradients are averaged over the ranks, as DeepSpeed's engine does. The
LM head's gradient is then that of the mean of the ranks' means (the tiled loss takes it in its forward,
unweighted): one process's where every rank holds as many label tokens, close to it elsewhere.

Two things differ from the documentation so that other variants can share the process: the registered
wrapper sits in transformers' ``sdpa`` key for the ALST step alone, and the tiled MLP's forward is set
on this model's MLP modules rather than on the class. The model runs on its own parameters (its
tiled backward accumulates into ``.grad``, as a user's model does); each step points them at the step's.
"""

from __future__ import annotations

import math
import types
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cpshard.bench.baselines import all_reduced, shard_batch
from cpshard.loss.cross_entropy import IGNORE_INDEX

#: the name the ALST attention is registered under (sdpa inside)
ATTENTION = "cpshard_bench_alst"
#: the logits of one TiledFusedLogitsLoss tile, in bytes (ArcticTraining's default: 1 GiB of fp32 logits)
LOGITS_TILE_BYTES = 1 << 30


def _attention(cp: int, model):
    """The ALST attention for ``model``'s sizes over ``cp`` ranks, made once per process (and kept in
    transformers' registry under a name of its own)."""
    config = model.config
    sizes = (
        cp,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.num_hidden_layers,
    )
    name = "_".join(map(str, (ATTENTION, *sizes)))
    if name not in ALL_ATTENTION_FUNCTIONS:
        _install(name, cp, model)
    return ALL_ATTENTION_FUNCTIONS[name]


def _install(name: str, cp: int, model) -> None:
    """``UlyssesSPAttentionHF.register_with_transformers``, its wrapper then moved to ``name``. DeepSpeed
    keeps one sequence-parallel group per process: a second registration releases the first's."""
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    mpu._release_sequence_parallel_groups()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=cp,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    ALL_ATTENTION_FUNCTIONS.register(name, ALL_ATTENTION_FUNCTIONS["sdpa"])
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


@contextmanager
def _as_sdpa(attention):
    """``attention`` in transformers' ``sdpa`` key, where DeepSpeed puts it (under a name of its own the
    model's k and v gradients come out wrong), for one step: forward and backward (which recomputes)."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


def _tiled_mlp_forward(self, x):
    """DeepSpeed's ``TiledMLP`` example for Llama's MLP: ceil(L / hidden) tiles, the ranks' largest."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    bs, seqlen, hidden = x.shape
    shards = torch.tensor(math.ceil(seqlen / hidden))
    dist.all_reduce(shards, op=dist.ReduceOp.MAX)
    compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    return TiledMLP.apply(mlp_forward, self, x, int(shards), compute_params)


def _loss_mean(model, x, y):
    """The mean loss of one tile, as ArcticTraining's: ``x`` and ``y`` come flat, ``[tokens, hidden]``
    and ``[tokens]``."""
    return F.cross_entropy(model.lm_head(x).float(), y, ignore_index=IGNORE_INDEX)


def _documented_loss(local_loss: torch.Tensor, good_tokens: torch.Tensor, group) -> torch.Tensor:
    """The loss of DeepSpeed's ALST documentation: each rank's mean weighted by every rank's token count,
    through a differentiable all-gather."""
    import torch.distributed.nn.functional as dnn

    losses = dnn.all_gather(local_loss, group=group)
    counts = dnn.all_gather(good_tokens, group=group)
    total = sum(loss * count for loss, count in zip(losses, counts) if count > 0)
    return total / max(sum(counts), 1)


def alst_step(model):
    """``step(params, batch, mesh) -> (loss, grads)``: one ALST training step on ``model`` (its own copy)."""
    for module in model.modules():
        if type(module).__name__.endswith("MLP"):
            module.forward = types.MethodType(_tiled_mlp_forward, module)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    owned = dict(model.named_parameters())

    def step(params: dict, batch: dict, mesh):
        group = mesh.get_group("cp")
        size = dist.get_world_size(group)
        with _as_sdpa(_attention(size, model)):
            loss = _forward_backward(model, owned, params, batch, group)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in owned.values()]
        *grads, loss = (t / size for t in all_reduced([*grads, loss.detach()], group))
        return loss, dict(zip(owned, grads))

    return step


def _forward_backward(model, owned: dict, params: dict, batch: dict, group) -> torch.Tensor:
    """The model on this rank's slice, the documented loss, and its backward into ``.grad``."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    for name, param in owned.items():  # the step's values, no copy
        param.data, param.grad = params[name].detach(), None
    local = shard_batch(batch, dist.get_rank(group), dist.get_world_size(group))
    hidden = model.model(
        input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
    ).last_hidden_state
    labels = local["shift_labels"]
    tiles = max(1, math.ceil(hidden.shape[1] * model.config.vocab_size * 4 / LOGITS_TILE_BYTES))
    loss_mean = TiledFusedLogitsLoss.apply(
        _loss_mean, model, hidden, labels, None, tiles, [model.lm_head.weight], "mean"
    )
    loss = _documented_loss(loss_mean, (labels != IGNORE_INDEX).sum(), group)
    loss.backward()
    return loss
