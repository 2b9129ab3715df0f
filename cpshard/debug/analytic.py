"""What a layout implies on a model: each declared move, the collectives it needs, its bytes per token.

Shared by :func:`~cpshard.debug.explain` (the layout, shown) and :func:`~cpshard.debug.trace_comms`
(the optimum a run is held to), so both count the same way. Bytes are those of each collective's
input on one rank, per token that rank holds after the cut (``B * L / cp`` tokens), in the model's
dtype. Token dims are named ``b`` and ``s``; attention specs name heads ``h`` and head size ``d``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cpshard.attention.ulysses import kv_replication
from cpshard.comm.redistribute import Move, plan
from cpshard.layouts.layout import Layout
from cpshard.runtime.install import attention_modules
from cpshard.spec.notation import Spec

TOKEN_NAMES = ("b", "s")


@dataclass(frozen=True)
class Step:
    """One declared move of one tensor: its specs, the moves :func:`plan` picks, and their bytes per token."""

    tensor: str
    src: Spec
    dst: Spec
    moves: tuple[Move, ...]
    #: None where a dimension's size is not known (only asked when an all-to-all needs it)
    bytes_per_token: int | None

    @property
    def collectives(self) -> int:
        """How many collectives the move launches (slices are local)."""
        return sum(move.kind == "all_to_all" for move in self.moves)

    def describe(self) -> str:
        """``all_to_all over cp``, ``slice over cp`` or ``nothing``."""
        return ", ".join(f"{move.kind} over {move.axis}" for move in self.moves) or "nothing"


def mesh_sizes(mesh) -> dict[str, int]:
    """Axis name -> size."""
    return dict(zip(mesh.mesh_dim_names or (), mesh.shape))


def _ways(spec: Spec, sizes: dict[str, int], names=None) -> int:
    return math.prod(
        sizes[axis] for dim in spec.dims if names is None or dim.name in names for axis in dim.axes
    )


def token_ways(layout: Layout, sizes: dict[str, int]) -> int:
    """Over how many ranks the tokens are split once cut: a rank holds ``B * L / token_ways`` of them."""
    return _ways(layout.hidden[1], sizes, TOKEN_NAMES)


def step(tensor: str, src: Spec, dst: Spec, dims: dict, layout: Layout, sizes: dict, itemsize: int) -> Step:
    """The move of ``tensor`` (global sizes of its non-token dims in ``dims``) from ``src`` to ``dst``."""
    moves = plan(src, dst)
    count = sum(move.kind == "all_to_all" for move in moves)
    rest = [dims.get(dim.name) for dim in src.dims if dim.name not in TOKEN_NAMES]
    if not count:
        return Step(tensor, src, dst, moves, 0)
    if None in rest:
        return Step(tensor, src, dst, moves, None)
    # a rank holds numel / ways(src) elements, and B * L / token_ways tokens
    per_token = math.prod(rest) * itemsize * token_ways(layout, sizes) // _ways(src, sizes)
    return Step(tensor, src, dst, moves, count * per_token)


#: the tensors that move in one collective where they share a dtype
#: (:func:`cpshard.attention.ulysses.heads_for_sequences`)
TOGETHER = ("q", "k", "v")


def collectives(steps: tuple[Step, ...]) -> int:
    """How many collectives ``steps`` launch: q, k and v in one for each move of theirs, the rest one each."""
    together = [s.collectives for s in steps if s.tensor in TOGETHER]
    return max(together, default=0) + sum(s.collectives for s in steps if s.tensor not in TOGETHER)


def head_dim(config, layout: Layout) -> int:
    """q's and k's width per head: a latent-attention model's nope and rope parts together (its config's
    ``head_dim`` is the rope part alone: DeepSeek-V2/V3, MiniCPM3, LongCat-Flash), else the config's
    ``head_dim`` or hidden / heads."""
    sizes = layout.sizes_config(config)
    nope, rope = getattr(sizes, "qk_nope_head_dim", None), getattr(sizes, "qk_rope_head_dim", None)
    if isinstance(nope, int) and isinstance(rope, int):
        return nope + rope
    return getattr(sizes, "head_dim", None) or sizes.hidden_size // layout.head_counts(config)[0]


def value_head_dim(config, layout: Layout) -> int:
    """v's (and the attention output's) width per head: a latent-attention model's ``v_head_dim``, else
    q's."""
    width = getattr(layout.sizes_config(config), "v_head_dim", None)
    return width if isinstance(width, int) else head_dim(config, layout)


def attention_steps(config, layout: Layout, sizes: dict[str, int], dtype: torch.dtype) -> tuple[Step, ...]:
    """q, k, v in and the output back, for one attention module, of the heads one tp rank holds. k and v
    carry their kv heads repeated as Ulysses needs (``kv_replication``); raises its ValueError when cp does
    not divide the heads."""
    heads, kv_heads = layout.tp_rank_head_counts(config, sizes.get("tp", 1))
    kv_total = kv_heads * kv_replication(heads, kv_heads, sizes["cp"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    qk, v = head_dim(config, layout), value_head_dim(config, layout)
    parts = (
        ("q", layout.qkv, heads, qk),
        ("k", layout.qkv, kv_total, qk),
        ("v", layout.qkv, kv_total, v),
        ("out", layout.attn_output, heads, v),
    )
    return tuple(step(name, *pair, {"h": h, "d": d}, layout, sizes, itemsize) for name, pair, h, d in parts)


def cut_steps(config, layout: Layout, sizes: dict[str, int], dtype: torch.dtype) -> tuple[Step, ...]:
    """The residual stream's cut at the first decoder layer, then the per-layer inputs' cuts."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    width = layout.sizes_config(config).hidden_size
    hidden = step("hidden_states", *layout.hidden, {"d": width}, layout, sizes, itemsize)
    return (
        hidden,
        *(step(key, src, dst, {}, layout, sizes, itemsize) for key, src, dst in layout.layer_inputs),
    )


def attention_paths(model, layout: Layout) -> list[str]:
    """The paths of ``model``'s attention modules (``model.layers.3.self_attn``), in layer order: every
    decoder layer's but those holding a recurrent mixer (MiniMax's lightning layers share the name)."""
    attention = {id(module) for module in attention_modules(model, layout)}
    return [name for name, module in model.named_modules() if id(module) in attention]
