"""The MLP a block of tokens at a time (ALST's TiledMLP): only one block's intermediate activations live.

A dense MLP works token by token, so running it over blocks of ``mlp_tile`` tokens gives every
token's output exactly. Each block runs under activation checkpointing: the forward keeps only the
block's input (a view of the layer's), and the backward recomputes one block's gate, up and activation
at a time, where the whole MLP keeps several ``[tokens, intermediate]`` tensors per layer until the
backward. The recompute runs inside the call with the call's parameters
(:func:`cpshard.runtime.recompute.checkpoint_in_call`), so tensor-parallel hooks act in it as in the
forward, and the weights are ``cp_forward``'s ``params``, not whatever the module holds by then.

Installed once per model as each MLP module's instance ``forward`` (marked, so that installing again
replaces it); it tiles only inside a call of a cp forward made with ``mlp_tile`` and is the module's own
forward everywhere else. A decoder layer recomputed under transformers' checkpointing re-enters the call
(:mod:`cpshard.runtime.recompute`), so its MLP tiles there too.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cpshard.call import current_call
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.layout import Layout
from cpshard.layouts.structure import submodule
from cpshard.runtime.recompute import OwnForward, checkpoint_in_call, install_forward


class TiledForward(OwnForward):
    """An MLP module's forward: blocks of ``mlp_tile`` tokens under checkpointing inside a call that asks
    for it, the module's own forward otherwise."""

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        call = current_call()
        tile = None if call is None else call.mlp_tile
        if tile is None or not torch.is_grad_enabled():
            return self.own_forward(hidden_states, *args, **kwargs)
        if args or kwargs:
            raise LayoutError(
                f"{call.name_of(self.module)}: mlp_tile runs an MLP called with the hidden states alone; "
                f"this one got {len(args)} more arguments and {sorted(kwargs)}; use mlp_tile=None"
            )
        # split, not slices: the input's gradient is one cat of the blocks' gradients, where each slice's
        # backward would make a zero tensor of the whole input's size
        forward = partial(_on_contiguous, self.own_forward)
        blocks = [
            checkpoint_in_call(checkpoint, call, self.module, forward, block, use_reentrant=False)
            for block in hidden_states.split(tile, dim=1)
        ]
        return torch.cat(blocks, dim=1)


def _on_contiguous(forward, block: torch.Tensor) -> torch.Tensor:
    """``forward`` of a contiguous copy of ``block``, made inside the block's checkpoint (its recompute
    makes it again): a block of a batch's positions is a strided view, and an MLP may reshape its input
    with ``view`` (GPT-2's Conv1D)."""
    return forward(block.contiguous())


def check_mlp_tile(layers: nn.ModuleList, layout: Layout, tile: int | None) -> None:
    """A :class:`LayoutError` where ``mlp_tile=tile`` cannot serve the layers: a tile that is no positive
    count, no MLP module in some layer, or experts inside it (routing by tokens is not a dense MLP's
    token-by-token work)."""
    if tile is None:
        return
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise LayoutError(f"mlp_tile={tile!r} is not a positive number of tokens")
    if layout.mlp is None:
        raise LayoutError(
            f"mlp_tile tiles each decoder layer's MLP module, and layout {layout.name!r} names none (its "
            "decoder has no MLP module per layer): make the cp forward without mlp_tile"
        )
    lacking = [
        index for index, layer in enumerate(layers) if not isinstance(submodule(layer, layout.mlp), nn.Module)
    ]
    if lacking:
        first = layers[lacking[0]]
        kind = type(first).__name__
        children = ", ".join(f"{name} ({type(child).__name__})" for name, child in first.named_children())
        raise LayoutError(
            f"mlp_tile tiles each decoder layer's MLP module, at the layout's mlp row ({layout.mlp!r}), "
            f"which {len(lacking)} of {len(layers)} layers lack (layer {lacking[0]}, a {kind}, "
            f"holds {children}): where the model names its MLP otherwise, save `cpshard layout MODEL`'s file "
            "with that name in its mlp row and pass it as layout=; where some layers hold none, make the cp "
            "forward without mlp_tile"
        )
    experts = [path for path in layout.experts if path.startswith(f"{layout.mlp}.")]
    if experts:
        raise LayoutError(f"mlp_tile tiles dense MLPs; {layout.mlp!r} holds the experts {experts}")
    # a layout need not name the experts it does not split (a derived one never does): read the modules
    routing = [(index, mlp) for index, mlp in enumerate(mlp_modules(layers, layout)) if _routes_tokens(mlp)]
    if routing:
        index, mlp = routing[0]
        raise LayoutError(
            f"mlp_tile tiles dense MLPs; {layout.mlp!r} routes tokens to experts in {len(routing)} of "
            f"{len(layers)} layers (layer {index}'s {type(mlp).__name__} first): make the cp forward without "
            "mlp_tile"
        )


def _routes_tokens(mlp: nn.Module) -> bool:
    """Whether an MLP module sends tokens to experts: it holds a weight with one slice per expert (3-D, as
    transformers' fused experts do) or a list of expert modules. A dense MLP holds neither."""
    expert_weights = any(p.dim() > 2 for p in mlp.parameters())
    return expert_weights or any(isinstance(m, nn.ModuleList) for m in mlp.modules())


def mlp_modules(layers: nn.ModuleList, layout: Layout) -> list[nn.Module]:
    """Each decoder layer's MLP module, as the layout names it."""
    return [layer.get_submodule(layout.mlp) for layer in layers]


def install_tiled_mlp(layers: nn.ModuleList, layout: Layout) -> None:
    """Give each layer's MLP the tiled forward (replacing one installed before, never nesting it)."""
    install_forward(mlp_modules(layers, layout), TiledForward)
