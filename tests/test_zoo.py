"""The transformers zoo: every causal LM type is exact under cp=2 or refused with a clear cpshard error.

Each type is built tiny and random (no downloads), then run with ``layout="auto"`` on a plain batch of odd
length (11 tokens) and on a left-padded batch, against one process on the same weights (a second model of
the type that cpshard never prepared: the model's own code): loss, logits and every gradient. A type is
*exact* when every row passes on both ranks (or lies within fp32 rounding of a float64 run:
:class:`cpshard.tools.parity.Rounding`; in bf16, ``CPSHARD_ZOO_DTYPE=bfloat16``, at 5e-2 and against fp32),
*refused* when cpshard raised its own error (the last frame of the traceback is in cpshard) on both ranks.
Anything else (an error from deep inside the model, a wrong result) fails the test. One process group
serves every type.
"""

from __future__ import annotations

import os
import resource
import traceback
import warnings

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import cpshard
from cpshard.runtime.difference import failing_rank
from cpshard.tools.check_config import DTYPES, RTOLS
from cpshard.tools.parity import WIDER, check_parity, failing_rows, float64_distances, widened
from cpshard.tools.tiny import tiny_batch, tiny_model

ZOO = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
#: types whose tiny config cannot be built here
UNBUILDABLE = {"gemma3n": "needs pillow and timm (its vision tower)"}
#: the classic GPT families that must be exact (bloom, gpt_neo and mpt through their rewritten attention,
#: :mod:`cpshard.layouts.family_attention`)
CLASSIC = (
    *("gpt2", "gpt_bigcode", "gpt_neox", "gptj", "codegen", "opt", "bloom", "falcon", "gpt_neo", "mpt"),
    *("llama", "mistral", "qwen2", "phi"),
)
#: multimodal causal LMs that must be exact driven with text alone (their sizes in the text part)
MULTIMODAL = ("gemma3", "gemma4", "llama4", "mllama")
#: the exact types today, per type of the zoo's models (in bf16 the model's own forward of inkling2_text and
#: inkling2_loop_text fails: transformers 5.25 mixes fp32 and bf16 in its kernel, and cpshard refuses them)
#: under bf16 autocast: dbrx's and xmod's own forwards fail (fp32 and bf16 mixed in an index_add_ and an
#: index_put); at cp 2 on 11 tokens inkling2_loop_text's probe rows differ by more than 1e-2 and its second
#: look cannot run in float64 (a matmul of fp32 and float64 inside it), so cpshard refuses it (at cp 4 on 37
#: tokens its rows pass, 189 exact)
MIN_EXACTS = {"float32": 191, "bfloat16": 189, "autocast bfloat16": 188}
#: the zoo's cp size (2 or 4) and tokens per row: CI runs 2 and 11; ``CPSHARD_ZOO_CP=4 CPSHARD_ZOO_TOKENS=37``
#: runs the same test at another shape (8 minutes here)
ZOO_CP = int(os.environ.get("CPSHARD_ZOO_CP", "2"))
ZOO_TOKENS = int(os.environ.get("CPSHARD_ZOO_TOKENS", "11"))
#: the zoo's models' type (float32 or bfloat16: ``CPSHARD_ZOO_DTYPE=bfloat16``, each row at bf16's tolerance,
#: its second look against fp32) and its tolerance
ZOO_DTYPE = os.environ.get("CPSHARD_ZOO_DTYPE", "float32")
#: mixed precision (``CPSHARD_ZOO_AUTOCAST=bfloat16``): fp32 models, cp and one process both under
#: ``torch.autocast`` in that type, each row at its tolerance, the second look against float64 (which
#: autocast leaves alone)
ZOO_AUTOCAST = os.environ.get("CPSHARD_ZOO_AUTOCAST")
ZOO_RTOL = RTOLS.get(ZOO_AUTOCAST or ZOO_DTYPE)
ZOO_MODE = f"autocast {ZOO_AUTOCAST}" if ZOO_AUTOCAST else ZOO_DTYPE
#: address space per rank beyond what it maps when the zoo starts (torch's CUDA build maps 3 GiB more than
#: its CPU build before any tensor)
_MEMORY_BUDGET = 5 << 30
_CPSHARD = os.path.dirname(cpshard.__file__)


def _raised_by_cpshard(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_CPSHARD)


def _tiny(model_type: str):
    return tiny_model(model_type, attn_implementation="auto", dtype=DTYPES[ZOO_DTYPE])


def _outcome(model_type: str, mesh) -> tuple[str, str]:
    try:
        # the reference is a second model of the type that cpshard never prepared: its own code, as a user's
        # plain model runs it (a prepared model sees cpshard's attention implementation name, which some
        # models branch on)
        model, own = (_tiny(model_type) for _ in range(2))
    except Exception as error:  # the zoo's own problem, reported apart
        return "unbuildable", f"{type(error).__name__}: {str(error)[:200]}"
    autocast = torch.autocast("cpu", dtype=DTYPES.get(ZOO_AUTOCAST), enabled=ZOO_AUTOCAST is not None)
    try:
        with autocast:
            return _compared(model_type, model, own, mesh)
    except Exception as error:
        clear = isinstance(error, ValueError | NotImplementedError) and _raised_by_cpshard(error)
        kind = "refused" if clear else "crash"
        return kind, f"{type(error).__name__}: {str(error)[:400]}"


def _compared(model_type: str, model, own, mesh) -> tuple[str, str]:
    """``model`` under cp against ``own`` (one process) on a plain and a left-padded batch."""
    cp_forward, params = cpshard.make_cp_forward(model), cpshard.params_of(model)
    for pad in (None, "left"):
        vocab = model.config.get_text_config(decoder=True).vocab_size
        batch = tiny_batch(vocab, 2, ZOO_TOKENS, pad=pad)
        failing = failing_rows([check_parity(own, batch, mesh, cp_forward, params)], ZOO_RTOL)
        # every rank takes the same branch (one all-reduce), so that a result that differs between ranks
        # cannot leave them in different collectives
        if failing_rank(bool(failing), mesh) is not None:  # rounding, or cp's error? (parity.Rounding)
            twin, cp_twin = (_tiny(model_type) for _ in range(2))
            twin_forward = cpshard.make_cp_forward(widened(cp_twin, WIDER[DTYPES[ZOO_DTYPE]]))
            rounding = float64_distances(twin, own, params, batch, mesh, cp_forward, twin_forward)
            failing = rounding.beyond(failing, ZOO_RTOL)
        if failing_rank(bool(failing), mesh) is not None:
            return "wrong", f"pad={pad}: {', '.join(failing[:4]) or 'on another rank'}"
    return "exact", ""


def _mapped_bytes() -> int:
    """This process's address space now (Linux's VmSize)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))


def classify(model_types: list[str]) -> dict[str, tuple[str, str]]:
    """On each rank: the outcome of every type."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    # a type too big raises, not kills; the soft limit alone, which the next group of types raises again
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = _mapped_bytes() + _MEMORY_BUDGET
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    mesh = cpshard.make_mesh(cp=ZOO_CP)
    return {model_type: _outcome(model_type, mesh) for model_type in model_types}


def _merged(per_rank: list[dict]) -> dict[str, tuple[str, str]]:
    """One outcome per type: the ranks' when they agree, else the worse (a type is exact on every rank)."""
    order = ("crash", "wrong", "unbuildable", "refused", "exact")
    return {t: min((r[t] for r in per_rank), key=lambda o: order.index(o[0])) for t in per_rank[0]}


@pytest.fixture(scope="module")
def zoo(ranks2, ranks4):
    if ZOO_CP not in (2, 4) or ZOO_RTOL is None:
        pytest.fail(
            f"CPSHARD_ZOO_CP={ZOO_CP}, CPSHARD_ZOO_DTYPE={ZOO_DTYPE}: the zoo runs at cp 2 or 4, in {DTYPES}"
        )
    ranks = {2: ranks2, 4: ranks4}[ZOO_CP]
    types = [t for t in ZOO if t not in UNBUILDABLE]
    outcomes = {}
    for start in range(0, len(types), 16):
        outcomes.update(_merged(ranks.run(classify, types[start : start + 16])))
    return outcomes


def test_every_type_is_exact_or_clearly_refused(zoo):
    bad = {t: o for t, o in zoo.items() if o[0] in ("crash", "wrong", "unbuildable")}
    assert len(zoo) + len(UNBUILDABLE) == len(ZOO)
    assert not bad, "\n".join(f"{t}: {kind}: {why}" for t, (kind, why) in sorted(bad.items()))


def test_enough_of_the_zoo_is_exact(zoo):
    exact = sorted(t for t, (kind, _) in zoo.items() if kind == "exact")
    assert len(exact) >= MIN_EXACTS[ZOO_MODE], (len(exact), exact)
    assert [t for t in CLASSIC + MULTIMODAL if t not in exact] == []
