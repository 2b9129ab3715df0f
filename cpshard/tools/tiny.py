"""Small random transformers models built from configs: for the demo, ``cpshard check`` and tests.

Nothing is downloaded: the config is transformers' default for the model type, shrunk.
Weights are drawn with a larger spread than transformers' default, so that logits and
gradients are of order one and parity tolerances mean something.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from cpshard.tools.tiny_sizes import PER_TYPE, SMALL


def _is_dropout(name: str, value) -> bool:
    return isinstance(value, float) and ("dropout" in name or name.endswith("pdrop"))


def _part_sizes(spec, given: dict) -> dict:
    """A part's sizes: its composite's defaults for it (dropout off), :data:`SMALL`, its type's entry of
    :data:`PER_TYPE`, then the sizes ``given`` for it."""
    defaults = {name: value for name, value in spec.init_kwargs.items() if not _is_dropout(name, value)}
    return {**defaults, **SMALL, **PER_TYPE.get(spec.model_type, {}), **given}


def _tiny_parts(model_type: str, sizes: dict) -> dict:
    """The sub-configs of a composite config (text, vision, audio...), each tiny as a type of its own, with
    the part's entry of ``sizes`` (a dict) on top: left to their defaults, they would build the
    full-size towers of a released model."""
    specs = getattr(CONFIG_MAPPING[model_type], "sub_configs_defaults", {})
    return {
        key: tiny_config(spec.model_type, **_part_sizes(spec, sizes.get(key, {})))
        for key, spec in specs.items()
        if not spec.optional and spec.model_type in CONFIG_MAPPING and isinstance(sizes.get(key, {}), dict)
    }


def _top_level(config_class) -> dict:
    """The settings of :data:`SMALL` that a composite config declares itself: the others belong to its
    parts (a multimodal config's text part has the heads), where a released config has them too."""
    declared = {field.name for field in dataclasses.fields(config_class)} | set(config_class.attribute_map)
    return {key: value for key, value in SMALL.items() if key in declared}


def tiny_config(model_type: str, **overrides):
    """transformers' config for ``model_type`` at the sizes of :data:`SMALL`, with ``overrides``;
    a composite config's parts are shrunk the same way (``text_config=dict(...)`` sizes its text part).

    Dropout is off (BERT and BART default to 0.1): a random mask drawn per run makes no two runs agree."""
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"unknown model type {model_type!r}")
    given = {**PER_TYPE.get(model_type, {}), **overrides}
    parts = _tiny_parts(model_type, given)
    base = _top_level(CONFIG_MAPPING[model_type]) if parts else SMALL
    sizes = {**base, **given, **parts}
    config = AutoConfig.for_model(
        model_type, **{key: value for key, value in sizes.items() if value is not None}
    )
    for name, value in config.to_dict().items():
        if _is_dropout(name, value) and name not in overrides:
            setattr(config, name, 0.0)
    return config


def causal_lm(config, attn_implementation: str | None = None):
    """transformers' causal LM for ``config``; one that takes a part of a composite config alone
    (MusicGen's takes its decoder) is built from that part."""
    taken = getattr(MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None), "config_class", type(config))
    parts = [getattr(config, key) for key in getattr(config, "sub_configs", {})]
    part = next((part for part in parts if isinstance(part, taken)), None)
    if isinstance(config, taken) or part is None:
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._from_config(
        part, attn_implementation=attn_implementation
    )


def tiny_model(
    model_type: str, seed: int = 0, attn_implementation: str = "auto", dtype=torch.float32, **overrides
):
    """A random causal LM of ``model_type``, the same on every process for the same seed.
    ``attn_implementation="auto"`` (the default): sdpa where the model supports it, else eager (Reformer,
    XLM, GPT-Neo...), as ``cpshard check --attn auto`` chooses."""
    if attn_implementation == "auto":
        try:
            return tiny_model(model_type, seed, "sdpa", dtype, **overrides)
        except ValueError as error:
            if "does not support an attention implementation" not in str(error):
                raise
            return tiny_model(model_type, seed, "eager", dtype, **overrides)
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = causal_lm(config, attn_implementation)
    if hasattr(model, "set_default_language"):  # X-MOD runs one language adapter, chosen up front
        model.set_default_language(config.languages[0])
    return model.to(dtype)


def _document_positions(length: int, generator: torch.Generator) -> torch.Tensor:
    """Positions of a row packed with documents of random lengths: each restarts at 0."""
    positions, start = [], 0
    while start < length:
        size = int(torch.randint(1, max(2, length // 2), (1,), generator=generator))
        positions.append(torch.arange(min(size, length - start)))
        start += size
    return torch.cat(positions)


def tiny_batch(
    vocab_size: int,
    batch: int,
    length: int,
    *,
    pad: str | None = None,
    packed: bool = False,
    embeds_dim: int | None = None,
    shift: bool = False,
    seed: int = 1,
) -> dict:
    """A random batch: ``pad`` 'left' or 'right' (a different amount per row) adds an attention_mask;
    ``packed`` adds position_ids that restart per document; ``embeds_dim`` gives inputs_embeds
    instead of ids; ``shift`` gives shift_labels instead of labels."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch, length), generator=generator)
    labels = ids.clone()
    result = {}
    if pad is not None:
        if pad not in ("left", "right"):
            raise ValueError(f"pad={pad!r}: choose 'left' or 'right'")
        mask = torch.ones(batch, length, dtype=torch.long)
        for row in range(batch):
            amount = (row * 3 + 1) % max(1, length // 2)  # rows differ; none is all padding
            if amount:
                mask[row, slice(0, amount) if pad == "left" else slice(length - amount, length)] = 0
        labels[mask == 0] = -100
        result["attention_mask"] = mask
    if packed:
        result["position_ids"] = torch.stack([_document_positions(length, generator) for _ in range(batch)])
    if embeds_dim is not None:
        result["inputs_embeds"] = torch.randn(batch, length, embeds_dim, generator=generator)
    else:
        result["input_ids"] = ids
    if shift:
        shifted = torch.randint(0, vocab_size, (batch, length), generator=generator)
        shifted[:, ::3] = -100
        result["shift_labels"] = shifted
    else:
        result["labels"] = labels
    return result


#: the characters :func:`tiny_tokenizer` knows, after its pad (0), eos (1) and unk (2) tokens
TINY_CHARACTERS = "abcdefghijklmnopqrstuvwxyz .,"


def tiny_tokenizer():
    """A tokenizer of one token per character, built here (no download): for text trainers (TRL's take a
    processing class) on tiny models. Ids below ``3 + len(TINY_CHARACTERS)`` (32): any tiny model's
    vocabulary holds them."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(TINY_CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
