"""The model's LM head as cpshard computes it, and the check that it is the model's own.

cpshard runs the head itself where the model's forward cannot serve: the loss without the logits
(:mod:`cpshard.loss.blocked`), and MoE models whose forward would add a slice-local router loss. It
knows the transforms transformers' heads apply after the projection (Granite's scaling, Gemma's
final softcap). A head that does anything else (Cohere's ``logit_scale``, say) would give a wrong
loss of the right shape, so before cpshard uses its own head on a model it runs the model's own
forward once on two tokens, with the decoder stood in for by fixed hidden states, and compares.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import MoeModelOutputWithPast

#: the verdicts of the check, per model and head transforms
_MATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def transform_logits(logits: torch.Tensor, config, transforms: tuple[str, ...]) -> torch.Tensor:
    """What the model's LM head does after the projection: the layout's ``head_transforms`` (Granite's
    scaling, Gemma's softcap), each where the config sets its amount."""
    scaling = getattr(config, "logits_scaling", None) if "logits_scaling" in transforms else None
    if scaling:
        logits = logits / scaling
    cap = (
        getattr(config, "final_logit_softcapping", None) if "final_logit_softcapping" in transforms else None
    )
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _head_names(model) -> dict[str, str]:
    """The LM head's parameters: their names in the head -> in the model (a tied weight's first name)."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    return {local: canonical[id(p)] for local, p in model.get_output_embeddings().named_parameters()}


def head_of(model, params: dict):
    """The LM head's weight and bias among ``params`` (a tied weight under the name params has for it)."""
    names = _head_names(model)
    return params[names["weight"]], params[names["bias"]] if "bias" in names else None


def own_logits(model, params: dict, hidden: torch.Tensor, transforms: tuple[str, ...]) -> torch.Tensor:
    """cpshard's logits of final hidden states ``hidden``: the head's projection and the ``transforms``."""
    return transform_logits(F.linear(hidden, *head_of(model, params)), model.config, transforms)


class _DecoderOutput(MoeModelOutputWithPast):
    """The stand-in decoder's output: any other field a model reads from it (GPT-2's cross_attentions)
    is None, as a decoder gives it when not asked for it."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _FixedDecoder(nn.Module):
    """Stands in for the decoder: returns the hidden states it was given, whatever the inputs."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return _DecoderOutput(last_hidden_state=self.hidden)


def _models_logits(model, params: dict, hidden: torch.Tensor, path: str) -> torch.Tensor:
    """The model's own forward on ``hidden`` as the output of its decoder at ``path`` (two token ids stand
    in as inputs)."""
    decoder = model.get_submodule(path)
    parent, _, attribute = path.rpartition(".")
    owner = model.get_submodule(parent)
    head = {name: value for name, value in params.items() if not name.startswith(path + ".")}
    setattr(owner, attribute, _FixedDecoder(hidden))
    try:
        ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        inputs = dict(input_ids=ids, use_cache=False, output_router_logits=False)
        return torch.func.functional_call(model, head, (), inputs, strict=False, tie_weights=True).logits
    finally:
        setattr(owner, attribute, decoder)


def _compare(model, params: dict, transforms: tuple[str, ...], decoder: str) -> bool:
    """Whether the model's forward on stand-in hidden states gives :func:`own_logits`, and its logits'
    gradient reaches no parameter outside the decoder but the head's weight and bias: one the model applies
    beside them (Dory's ``lm_head.logit_scale``) may leave the logits alike at its initial value, and its
    gradient would be missing."""
    weight, _ = head_of(model, params)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 2, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    outside = {
        name: value.detach().requires_grad_(value.is_floating_point())
        for name, value in params.items()
        if not name.startswith(decoder + ".")
    }
    leaves = {name: value for name, value in outside.items() if value.requires_grad}
    try:
        with torch.enable_grad():
            theirs = _models_logits(model, outside, hidden, decoder)
            reached = ()  # a tied weight is the decoder's: nothing outside it may be a leaf
            if leaves and theirs.requires_grad:
                reached = torch.autograd.grad(theirs.sum(), list(leaves.values()), allow_unused=True)
    except Exception:  # the model's forward wants more of its decoder than its output (FalconH1, Fuyu)
        return False
    head = {name for local, name in _head_names(model).items() if local in ("weight", "bias")}
    if any(grad is not None and name not in head for name, grad in zip(leaves, reached)):
        return False
    with torch.no_grad():
        ours = own_logits(model, params, hidden, transforms)
    alike = theirs.shape == ours.shape and theirs.dtype == ours.dtype  # BLT's logits: fp32 from bf16
    return alike and torch.allclose(theirs.detach(), ours, rtol=1e-5, atol=1e-5)


def head_matches(model, params: dict, transforms: tuple[str, ...], decoder: str) -> bool:
    """Whether :func:`own_logits` gives the model's own logits, and from the head's weight and bias alone
    (checked once per model, on two tokens); ``decoder``: the path of the model's decoder, stood in for by
    fixed hidden states."""
    verdicts = _MATCHES.setdefault(model, {})
    if transforms not in verdicts:
        verdicts[transforms] = _compare(model, params, transforms, decoder)
    return verdicts[transforms]
