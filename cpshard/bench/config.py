"""What ``cpshard bench`` measures: the model's sizes, the lengths, the cp sizes and the variants, checked as
the command line gives them (a bad value is a one-line usage error)."""

from __future__ import annotations

from dataclasses import dataclass

from cpshard.bench.variants import VARIANTS
from cpshard.tools.usage import UsageError, llama_sizes

#: the model sizes ``--model`` names: a vocabulary of 32,000, where the loss weighs most, and issue 18's
#: small one (an MLP 688 wide), where the rest of the step and any fixed overhead show
MODELS = {
    "vocab32k": dict(layers=2, hidden=256, heads=8, kv_heads=4, intermediate=None, vocab=32000),
    "vocab1k": dict(layers=2, hidden=256, heads=8, kv_heads=4, intermediate=688, vocab=1024),
}


@dataclass(frozen=True)
class BenchConfig:
    """What to measure: the model's sizes, the sequence lengths, the cp sizes and the variants."""

    seqs: tuple[int, ...] = (2048, 8192)
    cps: tuple[int, ...] = (2,)
    layers: int = 2
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 32000
    #: the MLP's width (None: 4x the hidden size)
    intermediate: int | None = None
    repeats: int = 3
    variants: tuple[str, ...] = VARIANTS
    seed: int = 0
    #: run the one-process baseline on rank 0 alone (the others wait): half its memory on the machine
    single_rank0_only: bool = False
    #: the per-rank step memory within which the longest L of each variant is fitted (MiB)
    budget_mib: int = 4096

    @classmethod
    def of_model(cls, model: str, **options) -> BenchConfig:
        """The sizes of :data:`MODELS` ``[model]``, with ``options`` over them."""
        if model not in MODELS:
            raise UsageError(f"--model {model}: choose from {', '.join(MODELS)}")
        return cls(**{**MODELS[model], **options})

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "repeats", "intermediate"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')}={getattr(self, name)} must be at least 1")
        if not self.seqs or min(self.seqs) < 1:
            raise UsageError(f"--seqs {list(self.seqs)}: give one or more lengths of at least 1")
        if not self.cps or min(self.cps) < 2:
            raise UsageError(
                f"--cp {list(self.cps)}: give one or more cp sizes of at least 2 (one process always runs)"
            )
        if self.vocab < 4:
            raise UsageError(f"--vocab={self.vocab} must be at least 4 (ids 0, 1, 2 are the special tokens)")
        for small, big in (("heads", "hidden"), ("kv_heads", "heads")):
            if getattr(self, big) % getattr(self, small):
                flag = small.replace("_", "-")
                raise UsageError(f"--{flag}={getattr(self, small)} must divide --{big}={getattr(self, big)}")
        unknown = sorted(set(self.variants) - set(VARIANTS))
        if unknown or not self.variants:
            raise UsageError(
                f"--variants {', '.join(unknown) or '(none)'}: choose from {', '.join(VARIANTS)}"
            )

    def model_sizes(self) -> dict:
        return llama_sizes(
            vocab=self.vocab,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            intermediate=self.intermediate,
        )
