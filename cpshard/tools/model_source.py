"""Where ``cpshard check``'s model comes from (:mod:`cpshard.tools.check`): a model type (a small random
model) or a folder (its config, with or without weights), built the same on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cpshard.layouts.registry import REGISTERED
from cpshard.tools.check_config import ATTNS, DTYPES, CheckConfig
from cpshard.tools.tiny import causal_lm, tiny_config, tiny_model
from cpshard.tools.usage import UsageError

#: the files a folder's weights may come in; without any, the folder's config gets random weights
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass(frozen=True)
class ModelSource:
    """A model type (random weights), or a folder with its weights or without (random weights)."""

    model_type: str | None = None
    folder: str | None = None
    weights: bool = False

    def describe(self) -> str:
        if self.folder is None:
            return f"random {self.model_type} (small)"
        return f"{self.folder} ({'its weights' if self.weights else 'random weights'})"


def resolve_source(model: str) -> ModelSource:
    """Decide whether ``model`` names a folder (which wins over a type of the same name) or a model type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"the folder {model!r} has no config.json (save one with config.save_pretrained)"
            )
        weights = any((path / name).is_file() for name in WEIGHT_FILES)
        return ModelSource(folder=str(path.resolve()), weights=weights)
    if path.exists():
        raise UsageError(f"{model!r} is a file; give a model folder (with config.json) or a model type")
    if model in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return ModelSource(model_type=model)
    if model in CONFIG_MAPPING:
        raise UsageError(
            f"model type {model!r} has no causal LM in transformers (cpshard runs the types of "
            "AutoModelForCausalLM, e.g. llama, gpt2, qwen3_next)"
        )
    if any(mark in model for mark in ("/", "\\", "~")) or model.startswith("."):
        raise UsageError(f"no folder {model!r}")
    known = ", ".join(sorted(REGISTERED))
    raise UsageError(
        f"unknown model type {model!r} and no folder of that name (a type of transformers' "
        f"AutoModelForCausalLM: {known} have files of their own, any other decoder a layout derived from it)"
    )


def hf_config(source: ModelSource, overrides: dict):
    """The transformers config the model is built from, with ``overrides`` (each a field it has)."""
    from transformers import AutoConfig

    if source.folder is None:
        fields = AutoConfig.for_model(source.model_type).to_dict()
        config = lambda: tiny_config(source.model_type, **overrides)  # noqa: E731
    else:
        fields = AutoConfig.from_pretrained(source.folder).to_dict()
        config = lambda: AutoConfig.from_pretrained(source.folder, **overrides)  # noqa: E731
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise UsageError(
            f"--set {unknown[0]}=...: the config of {source.describe()} has no field {unknown[0]!r}"
        )
    return config()


def build_model(source: ModelSource, config: CheckConfig):
    """The model, the same on every rank: loaded weights, or random ones drawn from ``config.seed``."""
    dtype, settings = DTYPES[config.dtype], config.settings
    if source.folder is None:
        return tiny_model(
            source.model_type, seed=config.seed, attn_implementation=config.attn, dtype=dtype, **settings
        )
    from transformers import AutoModelForCausalLM

    attn = None if config.attn == "auto" else config.attn  # transformers' own choice: sdpa, else eager
    if source.weights:
        return AutoModelForCausalLM.from_pretrained(
            source.folder, attn_implementation=attn, dtype=dtype, **settings
        )
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        model = causal_lm(hf_config(source, settings), attn_implementation=attn)
    return model.to(dtype)


def chosen_attention(model_config, source: ModelSource, attn: str) -> str:
    """The attention ``--attn`` runs: "auto" is sdpa where the model supports it, else eager; a usage error
    where the model does not support the one asked for (GPT-Neo and MPT have no sdpa)."""
    try:
        with torch.device("meta"):
            causal_lm(model_config, attn_implementation="sdpa" if attn == "auto" else attn)
    except ValueError as error:
        if "does not support an attention implementation" not in str(error):
            raise
        if attn == "auto":
            return "eager"
        others = [other for other in ATTNS if other not in (attn, "auto")]
        raise UsageError(
            f"{source.describe()} does not support --attn {attn}: use --attn {others[0]}"
        ) from None
    return "sdpa" if attn == "auto" else attn
