"""``cpshard.generate``: a prompt prefilled under cp, then one token per row per step, the same on every
rank; rows stop at ``eos_token_id`` and are padded after it, as transformers' ``generate`` does.

What it does not serve is refused up front, on every rank alike (the arguments and the model's generation
config are the same on every rank): beam search, speculative decoding, the logits processors of the
generation config other than temperature, top-k and top-p.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict

import torch
import torch.distributed as dist
from transformers import GenerationConfig

from cpshard.comm.collectives import all_gather_rows
from cpshard.comm.consensus import differing_ranks, gather_checked, gather_texts, items_text, what_differs
from cpshard.generation.decode import make_cp_decode
from cpshard.generation.prefill import make_cp_prefill
from cpshard.generation.sampling import Sampling, next_tokens
from cpshard.layouts.structure import text_config
from cpshard.runtime.forward import params_of

_MODELS_OWN = object()
#: a rank's mark in the arguments' all-gather where its own arguments were refused (a CRC is never negative)
_REFUSED = -1
SPECULATIVE = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "assistant_tokenizer")
#: generation-config settings that change which tokens ``model.generate`` picks, not applied by cpshard
REFUSED_SETTINGS = (
    "num_beams",
    "num_beam_groups",
    "penalty_alpha",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "guidance_scale",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "top_h",
    "renormalize_logits",
    "exponential_decay_length_penalty",
    "watermarking_config",
    "stop_strings",
    "max_time",
)


#: what transformers' ``generate`` takes for a setting neither the call nor the model's generation config
#: sets (transformers 5.25's ``GenerationConfig._get_default_generation_params``): the sampling settings,
#: and the values at which the settings cpshard does not apply change nothing
TRANSFORMERS_DEFAULTS = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "num_beams": 1,
    "num_beam_groups": 1,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_length": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}
SAMPLING_SETTINGS = ("do_sample", "temperature", "top_k", "top_p")


def _no_op(name: str, value) -> bool:
    return value is None or (name in TRANSFORMERS_DEFAULTS and value == TRANSFORMERS_DEFAULTS[name])


def sampling_for(generation_config, given: dict) -> Sampling:
    """How ``generate`` picks tokens, as ``model.generate`` resolves it: each setting the call gives, else the
    model's generation config's, else transformers' default (greedy; when sampling, top-k 50)."""

    def resolved(name: str):
        if given[name] is not _MODELS_OWN:
            return given[name]
        own = getattr(generation_config, name, None)
        return own if own is not None else TRANSFORMERS_DEFAULTS[name]

    return Sampling(*(resolved(name) for name in SAMPLING_SETTINGS))


def refuse_unsupported(options: dict, generation_config) -> None:
    """Raise a ValueError naming what ``generate`` would not apply: options beyond its arguments (beam search,
    speculative decoding, ...) and settings of the model's generation config (leaving a default, or a value
    that changes nothing such as ``repetition_penalty=1.0``, is fine)."""
    default = GenerationConfig()
    for name, value in options.items():
        if name in SPECULATIVE:
            raise ValueError(
                f"speculative decoding ({name}) is not served by cpshard.generate: it decodes one token "
                "per row per step"
            )
        if name == "num_beams" and value not in (None, 1):
            raise ValueError(
                f"beam search (num_beams={value}) is not served by cpshard.generate: greedy "
                "(do_sample=False) or sampling (do_sample=True, temperature, top_k, top_p)"
            )
        if value != getattr(default, name, _MODELS_OWN) and not _no_op(name, value):
            raise ValueError(
                f"cpshard.generate does not take {name}={value!r}; it takes max_new_tokens, do_sample, "
                "temperature, top_k, top_p, eos_token_id and generator"
            )
    changed = {
        name: getattr(generation_config, name)
        for name in REFUSED_SETTINGS
        if getattr(generation_config, name, None) != getattr(default, name, None)
        and not _no_op(name, getattr(generation_config, name))
    }
    if changed:
        raise ValueError(
            f"model.generation_config sets {changed}, which cpshard.generate does not apply (it would pick "
            "other tokens than model.generate); set them back to GenerationConfig()'s defaults"
        )


def _token_ids(value) -> torch.Tensor | None:
    if value is None:
        return None
    return torch.tensor([value] if isinstance(value, int) else list(value), dtype=torch.long)


def stop_and_pad_ids(model, eos_token_id) -> tuple[torch.Tensor | None, int | None]:
    """``(eos ids or None, pad id)``: the model's generation config's eos (else its config's) unless given;
    padding after eos with the pad token, else the first eos, as transformers does."""
    config, generation = text_config(model), model.generation_config
    if eos_token_id is _MODELS_OWN:
        eos_token_id = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
    eos = _token_ids(eos_token_id)
    pad = generation.pad_token_id if generation.pad_token_id is not None else config.pad_token_id
    if pad is None and eos is not None:
        pad = int(eos[0])
    return eos, pad


def shared_generator(group, device: torch.device) -> torch.Generator:
    """A generator on ``device`` (the logits') seeded alike on every rank of ``group`` (rank 0's seed, one
    all-gather)."""
    seed = torch.randint(0, 1 << 62, (1,))
    seed = int(all_gather_rows(seed, group, name="sampling seed")[0, 0])
    return torch.Generator(device=device).manual_seed(seed)


def _resolved(model, max_new_tokens, given: dict, eos_token_id, unsupported: dict):
    """``(sampling, eos ids or None, pad id)`` of a ``generate`` call, or a ValueError saying what it does not
    serve."""
    refuse_unsupported(unsupported, model.generation_config)
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: a positive integer")
    return sampling_for(model.generation_config, given), *stop_and_pad_ids(model, eos_token_id)


def check_same_arguments(arguments: str | None, group, failed: Exception | None) -> None:
    """Every rank raises unless every rank's call resolved to the same ``arguments`` (each rank's loop runs
    its own count of decode steps: ranks that stopped apart would mismatch in a collective, as a gloo abort
    or a hang); ``failed``: this rank's arguments were refused (it raises that, the others name it)."""
    row = torch.tensor([zlib.crc32((arguments or "").encode())])
    every, refused = gather_checked(row, group, "generate arguments", failed, _REFUSED)
    if refused:
        raise ValueError(f"cpshard.generate: ranks {refused} refused their arguments (each says why)")
    ranks = dist.get_process_group_ranks(group)
    differing = differing_ranks(every, ranks)
    if differing:
        called = what_differs(gather_texts(arguments, group, "generate's arguments"), ranks, differing[0])
        raise ValueError(
            f"cpshard.generate: ranks {differing} were called otherwise than rank {ranks[0]} ({called}); "
            "every rank generates with the same max_new_tokens, sampling and eos, each with a generator or "
            "none"
        )


def check_same_everywhere(tokens: torch.Tensor, group) -> None:
    """Every rank raises unless every rank generated the same tokens."""
    every = all_gather_rows(tokens, group, name="generated tokens")
    ranks = dist.get_process_group_ranks(group)
    differing = differing_ranks(every, ranks)
    if differing:
        raise ValueError(
            f"cpshard.generate: ranks {differing} generated other tokens than rank {ranks[0]}; seed the "
            "generators alike on every rank (or pass generator=None)"
        )


def generate(
    model,
    batch: dict,
    mesh,
    *,
    max_new_tokens: int,
    do_sample=_MODELS_OWN,
    temperature=_MODELS_OWN,
    top_k=_MODELS_OWN,
    top_p=_MODELS_OWN,
    eos_token_id=_MODELS_OWN,
    generator: torch.Generator | None = None,
    **unsupported,
) -> torch.Tensor:
    """``[B, L + n]``: the prompt followed by ``n <= max_new_tokens`` new tokens (fewer when every row has
    reached eos), ``pad_token_id`` after a row's eos; the same on every rank. ``eos_token_id=None``
    generates exactly ``max_new_tokens``. ``do_sample``, ``temperature``, ``top_k``, ``top_p`` not given are
    the model's generation config's, else transformers' defaults, as ``model.generate`` takes them (greedy;
    when sampling, top-k 50; ``top_k=None``: no top-k). Sampling draws from ``generator``, which must be
    seeded alike on every rank and be on the model's device (``None``: one seeded from rank 0's)."""
    group = mesh.get_group("cp")
    given = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    try:
        sampling, eos, pad = _resolved(model, max_new_tokens, given, eos_token_id, unsupported)
        eos_ids = None if eos is None else eos.tolist()
        resolved = {"max_new_tokens": max_new_tokens, **asdict(sampling), "eos_token_id": eos_ids}
        resolved.update(pad_token_id=pad, generator_given=generator is not None)
        arguments, failed = items_text(resolved), None
    except (TypeError, ValueError) as raised:  # a value of the wrong type fails in the resolving
        arguments, failed = None, raised
    check_same_arguments(arguments, group, failed)
    cp_prefill, cp_decode = make_cp_prefill(model), make_cp_decode(model)
    params = params_of(model)
    logits, cache = cp_prefill(params, batch, mesh)
    if sampling.do_sample and generator is None:
        generator = shared_generator(group, logits.device)
    unfinished = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    eos = None if eos is None else eos.to(logits.device)
    new = []
    for step in range(max_new_tokens):
        tokens = next_tokens(logits, sampling, generator)
        if eos is not None:
            tokens = tokens.masked_fill(~unfinished, pad)
            unfinished &= ~torch.isin(tokens, eos)
        new.append(tokens)
        if not unfinished.any() or step + 1 == max_new_tokens:
            break
        logits, cache = cp_decode(params, tokens, cache, mesh)
    out = torch.cat([batch["input_ids"], torch.stack(new, dim=1).to(batch["input_ids"].dtype)], dim=1)
    check_same_everywhere(out, group)
    return out
