"""The options of ``cpshard check`` (:mod:`cpshard.tools.check`): what a command line may say, checked where
it is parsed, and each dtype's tolerance."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from cpshard.attention.choice import IMPLEMENTATIONS
from cpshard.tools.parity import RTOL
from cpshard.tools.usage import UsageError, check_predicts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: per dtype, the largest difference a row may have, relative to the row's reference scale
RTOLS = {"float32": RTOL, "bfloat16": 5e-2}
#: the names the report gives a check's dtype and the wider one of its second look (:data:`WIDER`)
SHORT_NAMES = {torch.float64: "float64", torch.float32: "fp32", torch.bfloat16: "bf16"}
#: "auto": sdpa where the model supports it, else eager (GPT-Neo, MPT, XLM, DeepSeek-V4 have no sdpa)
ATTNS = ("auto", "sdpa", "eager")
#: the types ``--autocast`` may run an fp32 model's matmuls in (cp and one process both under it)
AUTOCASTS = ("bfloat16",)
PADS = ("left", "right")


@dataclass(frozen=True)
class CheckConfig:
    """The check's options: ``cpshard check MODEL --cp N --<field> ...``."""

    model: str
    cp: int = 2
    implementation: str = "auto"
    seq: int = 64
    batch: int = 2
    pad: str | None = None
    packed: bool = False
    dtype: str = "float32"
    attn: str = "auto"
    seed: int = 0
    #: a row passes within this times its scale (None: the dtype's :data:`RTOLS`)
    tolerance: float | None = None
    #: config fields set over the model's (``--set key=value``): ``(key, value)`` pairs
    overrides: tuple[tuple[str, object], ...] = ()
    #: run cp and one process under ``torch.autocast`` in this type (None: no autocast); last, so that the
    #: fields before it keep their places
    autocast: str | None = None

    def __post_init__(self):
        for name in ("cp", "seq", "batch"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name}={getattr(self, name)} must be at least 1")
        check_predicts(self.seq)
        for name, allowed in (
            ("implementation", IMPLEMENTATIONS),
            ("dtype", DTYPES),
            ("attn", ATTNS),
            ("pad", PADS),
            ("autocast", AUTOCASTS),
        ):
            value = getattr(self, name)
            if value not in allowed and not (name in ("pad", "autocast") and value is None):
                raise UsageError(f"--{name}={value!r}: choose one of {', '.join(allowed)}")
        if self.autocast and self.dtype != "float32":
            raise UsageError(
                f"--autocast {self.autocast} runs an fp32 model's matmuls in {self.autocast}: use it with "
                f"--dtype float32 (a {self.dtype} model is checked in its own type without it)"
            )
        if self.tolerance is not None and not self.tolerance > 0:
            raise UsageError(f"--rtol={self.tolerance}: a tolerance is a positive number")
        if self.pad and self.seq < 4:  # tiny_batch pads a row by up to half its length
            raise UsageError(f"--pad {self.pad} needs --seq of at least 4: shorter rows get no padding")

    @property
    def settings(self) -> dict:
        return dict(self.overrides)

    @property
    def rtol(self) -> float:
        return RTOLS[self.autocast or self.dtype] if self.tolerance is None else self.tolerance

    def under_autocast(self):
        """The context the check's runs take: ``torch.autocast`` on the ranks' CPUs in ``autocast``'s type,
        or one that does nothing."""
        return torch.autocast("cpu", dtype=DTYPES.get(self.autocast), enabled=self.autocast is not None)


def parse_override(text: str) -> tuple[str, object]:
    """``key=value`` from the command line: the value as JSON (numbers, true/false, null, lists), else
    the plain string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise UsageError(
            f"--set {text!r}: write --set key=value, with key a config field (e.g. num_hidden_layers=4)"
        )
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value
