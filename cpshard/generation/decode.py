"""``make_cp_decode``: one new token per row, attending over a KV cache split over the cp ranks.

Every rank runs the model's own forward on the new tokens (one per row, nothing to split); its attention
function attends with this rank's share of the cache and merges every rank's partial result exactly
(:mod:`cpshard.attention.decode`). Per step, rank 0 puts ``layers x B x Hq x (D + 1) x 4`` bytes into
collectives (each layer's partial output and log-sum-exp, in fp32), and ``(B + 1) x 8`` to check that every
rank decodes the same tokens with its own cache.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from cpshard.attention.decode import DecodeStep
from cpshard.attention.kv_cache import ShardedKVCache
from cpshard.call import decoding
from cpshard.comm.collectives import all_gather_rows
from cpshard.generation.prefill import check_mesh_and_params, check_servable, layers_of
from cpshard.layouts.registry import resolve_layout
from cpshard.runtime.install import attention_modules, ensure_installed, install
from cpshard.runtime.plan import check_params


def check_step(tokens, cache: ShardedKVCache, group) -> None:
    """``tokens`` is ``[B]`` integer ids, the same on every rank, and each rank holds its own share of the
    cache (one all-gather of both), or every rank raises."""
    rows = cache.attention_mask.shape[0]
    shaped = isinstance(tokens, torch.Tensor) and tokens.shape == (rows,) and not tokens.is_floating_point()
    own = (cache.rank, cache.size) == (dist.get_rank(group), dist.get_world_size(group))
    mine = tokens.long() if shaped else torch.full((rows,), -1, dtype=torch.long)
    every = all_gather_rows(torch.cat([mine, mine.new_tensor([own])]), group, name="decode tokens")
    if not shaped:
        raise ValueError(f"cp_decode takes one token id per row: a [{rows}] integer tensor, got {tokens!r}")
    strangers = (every[:, -1] == 0).nonzero().flatten().tolist()
    if strangers:
        raise ValueError(
            f"cp_decode: ranks {strangers} hold a cache that another rank or cp size made; give each rank "
            "the cache its own cp_prefill (or cp_decode) returned"
        )
    differing = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
    if differing:
        raise ValueError(
            f"cp_decode: ranks {differing} decode other tokens than rank 0; every rank of the cp group "
            "must decode the same tokens (sample with generators seeded alike)"
        )


class CPDecode:
    """A cp decode step for one model: ``cp_decode(params, tokens, cache, mesh) -> (logits, cache)``."""

    def __init__(self, model, layout):
        check_servable(model, layout)
        self.model, self.layout = model, layout
        self.names = {id(module): name for name, module in model.named_modules()}
        modules = attention_modules(model, layout)
        self.layers = len(modules)
        self.layer_of = layers_of(modules)
        install(model, layout)

    def __call__(
        self, params: dict, tokens, cache: ShardedKVCache, mesh
    ) -> tuple[torch.Tensor, ShardedKVCache]:
        check_mesh_and_params(mesh, params)
        check_params(self.model, params)
        group = mesh.get_group("cp")
        check_step(tokens, cache, group)
        if len(cache.layers) < self.layers:
            raise ValueError(f"a cache of {len(cache.layers)} layers for a model of {self.layers}")
        ensure_installed(self.model, self.layout, tp=1)  # decode serves cp meshes only
        mask, positions = cache.extended()
        step = DecodeStep(cache, mask, positions, self.layer_of, self.names, group, states=cache.recurrent)
        inputs = {"input_ids": tokens[:, None], "position_ids": positions[:, -1:], "use_cache": False}
        with torch.no_grad(), decoding(step):
            output = torch.func.functional_call(
                self.model, params, (), inputs, strict=False, tie_weights=True
            )
        if step.new_states.keys() != cache.recurrent.keys():
            raise ValueError(
                f"cp_decode carried the recurrent states {sorted(cache.recurrent)} and the model's recurrent "
                f"layers took {sorted(step.new_states)}: prefill and decode must run the same model"
            )
        if len(step.shards) != len(cache.layers):  # a looped layer attended fewer times than in the prefill
            raise ValueError(
                f"cp_decode attended over {len(step.shards)} of the cache's {len(cache.layers)} layers: "
                "prefill and decode must run the same model"
            )
        layers = tuple(step.shards[number] for number in range(len(cache.layers)))
        return output.logits[:, -1], replace(
            cache, layers=layers, attention_mask=mask, position_ids=positions, recurrent=step.new_states
        )


def make_cp_decode(model, *, layout="auto") -> CPDecode:
    """Prepare ``model`` once and return its ``cp_decode(params, tokens, cache, mesh) -> (logits, cache)``:
    ``tokens`` ``[B]`` (one per row, the same on every rank) appended to the cache of ``cp_prefill`` (or of
    the last ``cp_decode``); the logits ``[B, V]`` of the new tokens, the same on every rank, and the grown
    cache (the given one is left as it was)."""
    return CPDecode(model, resolve_layout(model, layout))
