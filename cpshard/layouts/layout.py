"""What an architecture declares, as data: where the sequence is cut and how attention moves.

A :class:`Layout` holds no architecture facts of its own: every row is written out in a layout
file (``layouts/decoder.py`` is the generic transformers decoder, ``layouts/llama.py`` the whole
Llama table) or derived from a model (:mod:`cpshard.layouts.derive`). Reading a model against a
layout (which modules are its attention, where it does not fit) is :mod:`cpshard.layouts.structure`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from types import MappingProxyType

from torch import nn

from cpshard.spec.notation import Spec

#: how a layout's tensor-parallel plan may treat a module (see :mod:`cpshard.parallel.placement`)
TP_STYLES = ("colwise", "rowwise", "per_head")
#: what an LM head may do after its projection, by the config field that holds the amount
HEAD_TRANSFORMS = ("logits_scaling", "final_logit_softcapping")


#: the chunked kernels of the recurrent mixers cp serves by state passing, by the slot a mixer calls them
#: through (its ``_kernel_funcs``, kept per module by the kernels package), and how their state decays
RECURRENT_KERNELS = MappingProxyType(
    {
        "chunk_gated_delta_rule": "matrix",
        "chunk_kda": "matrix",
        "lightning": "constant",
        "rg_lru": "diagonal",  # RecurrentGemma's RG-LRU: a decay per channel
        "rwkv": "constant",  # RWKV's WKV: a constant decay per channel
        "mlstm": "scalar",  # xLSTM's mLSTM: a forget gate per head and token
        "zaya_cca": "none",  # ZAYA's attention projection: short convolutions and a delayed value, no state
        "inkling": "none",  # Inkling's decoder layer: four short convolutions, no state
        "inkling2": "none",  # Inkling2's decoder layers: four short convolutions, no state
        "mamba_chunk_scan_combined": "scalar",  # Mamba2's SSD scan
        "selective_scan_fn": "diagonal",  # Mamba1's selective scan: a decay per channel and state dim
        "causal_conv1d_fn": "none",  # a short convolution alone (LFM2's ShortConv): no state past its window
    }
)
#: slots of fused kernels that do a whole mixer in one call, bypassing the slots above (cp turns them off)
FUSED_SLOTS = frozenset({"mamba_split_conv1d_scan_combined"})
#: MiniMax's lightning attention: no kernel slot, its block loop inline; served by hooks (kernel "lightning")
LIGHTNING = "MiniMaxLightningAttention"
#: RecurrentGemma's recurrent block: its scan a method, its convolution a module; served by a slot on the
#: method and hooks (kernel "rg_lru")
RG_LRU = "RecurrentGemmaRecurrentBlock"
#: RWKV's time mixing: its WKV a function of its module, its token shifts inline; served by hooks and the
#: function shadowed (kernel "rwkv")
RWKV = "RwkvSelfAttention"
#: xLSTM's mLSTM layer: its backend a module, whose forward cpshard takes (kernel "mlstm")
XLSTM = "xLSTMLayer"
#: ZAYA's attention projection: convolutions of q and k and a delayed value inline (kernel "zaya_cca")
ZAYA_CCA = "ZayaCCAProjection"
#: Inkling's decoder layer: four convolutions, attention that places its queries by index (kernel "inkling")
INKLING = "InklingDecoderLayer"
#: Inkling2's decoder layers (and Inkling2-Loop's): as Inkling's, beside a stack of block states the decoder
#: keeps between its layers (kernel "inkling2", which cuts the sequence where it enters the decoder)
INKLING2 = (
    "Inkling2SlidingDecoderLayer",
    "Inkling2FullDecoderLayer",
    "Inkling2LoopSlidingDecoderLayer",
    "Inkling2LoopSlidingLoopDecoderLayer",
    "Inkling2LoopFullDecoderLayer",
    "Inkling2LoopFullLoopDecoderLayer",
)
#: modules that call the attention registry across a position's own copies, not along the sequence
#: (Inkling2's block attention residuals: the position's block states are the keys): nothing crosses
#: positions, so cp's attention runs the model's own function on each rank's slice as it is
PER_POSITION_ATTENTION = (
    "Inkling2BlockAttentionResidual",
    "Inkling2LoopBlockAttentionResidual",
    "Inkling2LoopMessageAttentionResidual",
)
#: attention modules that select keys per query (DeepSeek's sparse attention and HY-V4's, Doge's dynamic mask,
#: Kolibri 1.1's indexed layers, DeepSeek-V4's compressed layers), which cp serves with the rank's queries
#: against gathered keys (:mod:`cpshard.attention.sparse`)
SPARSE_ATTENTION = (
    "DeepseekV32Attention",
    "GlmMoeDsaAttention",
    "AXK2Attention",
    "Dots3NoteTextAttention",
    "DogeAttention",
    "HYV4Attention",
    "Kolibri1_1Attention",
    "DeepseekV4Attention",
)
#: where not every module of a :data:`SPARSE_ATTENTION` class selects its keys, the attribute those that do
#: have set (Kolibri 1.1's indexed layers, DeepSeek-V4's compressed layers); the others are cp's ordinary
#: attention over their own slices
SELECTING_WITH = MappingProxyType({"Kolibri1_1Attention": "indexer", "DeepseekV4Attention": "compressor"})
#: the recurrent kernels served by hooks on a mixer of a known class (or classes), not by a kernel slot
HOOKED = MappingProxyType(
    {
        "lightning": (LIGHTNING,),
        "rg_lru": (RG_LRU,),
        "rwkv": (RWKV,),
        "mlstm": (XLSTM,),
        "zaya_cca": (ZAYA_CCA,),
        "inkling": (INKLING,),
        "inkling2": INKLING2,
    }
)
#: the hooked kernels whose decoder keeps per-position values of its own between its layers: cut where the
#: sequence enters the decoder (:attr:`Layout.cut_at_entry`)
CUT_AT_ENTRY = frozenset({"inkling2"})
#: the slot of the short causal convolution in front of them
CONV_SLOT = "causal_conv1d_fn"
#: the decoders that run their layers from more than one list, whole-sequence states kept beside them (HRM's
#: H and L stacks; XLM's attentions, norms and FFNs and its padding mask), whose code cpshard has read (every
#: op per position but attention): cut where the sequence enters the decoder (:attr:`Layout.cut_at_entry`);
#: any other such decoder is refused. ProphetNet's builds its streams itself: its hooks cut them where they
#: enter its first layer (:mod:`cpshard.recurrent.prophetnet`), the layers' generic cut stepping aside alike
ENTERED_DECODERS = frozenset({"HrmTextModel", "XLMModel", "ProphetNetDecoder", "ReformerModel", "BltModel"})
#: attention modules that no registry function computes, which cp runs whole on every rank over the gathered
#: sequence, keeping the rank's rows of their output (ProphetNet's n-stream attention): cp's own attention
#: (the registry, its recompute, per-head parameters) leaves them alone
WHOLE_ATTENTION = frozenset({"ProphetNetNgramSelfAttention"})
#: attention modules that no registry function computes, whose own forward cp runs on a share of the heads
#: over the gathered sequence (Reformer's LSH and local attention: :mod:`cpshard.recurrent.reformer`): cp's
#: own attention leaves them alone too
HEAD_SPLIT_ATTENTION = frozenset({"ReformerAttention"})


@dataclass(frozen=True)
class Recurrent:
    """A recurrent mixer some decoder layers hold instead of attention (linear attention: Gated DeltaNet,
    KDA, lightning; state-space: Mamba2's SSD). cp runs the model's own kernel on each rank's slice from a
    zero state and passes a fixed-size summary of each slice between the ranks (:mod:`cpshard.recurrent`);
    its convolution takes a halo of ``kernel - 1`` positions from the rank before."""

    #: the mixer's path inside a decoder layer ("": the layer itself, Inkling's)
    module: str
    #: the slot of its chunked kernel, one of :data:`RECURRENT_KERNELS` (one of :data:`HOOKED`: the module)
    kernel: str
    #: the slot of its short causal convolution (:data:`CONV_SLOT`), None where it has none
    conv: str | None
    #: one sequence's state, fp32: batch, heads, key and value dims (what the kernel's state is; stated, not
    #: chosen: cpshard reads it from the kernel)
    state: Spec = Spec("b h k v")
    #: how the state carried into a slice reaches its end: "matrix" (delta rules: ``M S_in``), "scalar"
    #: (SSD: ``exp(A sum(dt))`` per row and head, its state ``[P, N]`` read as ``v k``), "constant"
    #: (lightning attention: ``e^{-s T} S_in``, known without data), "diagonal" (Mamba1: per channel and
    #: state dim, served split over channels; RG-LRU: per channel, by state passing) or "none" (a
    #: convolution alone, whose kernel is its ``conv``: only its halo crosses ranks). The kernel's
    #: (:data:`RECURRENT_KERNELS`), stated, not chosen; None (the default) fills it in
    decay: str | None = None

    def __post_init__(self):
        """A row's kernel, convolution, state and decay are facts of the kernel cpshard serves: a row that
        names another is refused here, not ignored where it runs."""
        where = f"Recurrent({self.module!r})"
        if self.kernel not in RECURRENT_KERNELS:
            raise ValueError(
                f"{where}: kernel={self.kernel!r} is not a kernel cpshard serves; one of "
                f"{', '.join(RECURRENT_KERNELS)}"
            )
        if self.conv not in (None, CONV_SLOT):
            raise ValueError(f"{where}: conv={self.conv!r}; the convolution slot is {CONV_SLOT!r}, or None")
        decay = RECURRENT_KERNELS[self.kernel]
        if self.decay not in (None, decay):
            raise ValueError(
                f"{where}: {self.kernel}'s state decays as {decay!r}, not {self.decay!r} (the row states the "
                "kernel's fact; leave decay out, or give None)"
            )
        object.__setattr__(self, "decay", decay)
        if self.state != Spec("b h k v"):
            raise ValueError(
                f"{where}: state={self.state}; cpshard reads a kernel's state from the kernel, as "
                "Spec('b h k v') states it (leave state out)"
            )


#: the mesh axis a layout's specs split over (tensor parallelism is its plan's, experts' its own rows')
LAYOUT_AXIS = "cp"
#: what a cp call gives: the logits split over the sequence (the row states it)
LOGITS = Spec(f"b s@{LAYOUT_AXIS} v")


def _spec_problems(layout: Layout) -> list[str]:
    """What in ``layout``'s specs cpshard could not run, or would not read as written: a pair whose two specs
    name other dimensions (a move changes placements, not names), a spec split over another axis than cp,
    logits other than cp gives."""
    pairs = [
        ("hidden", layout.hidden),
        *((f"layer_inputs {name!r}", (before, after)) for name, before, after in layout.layer_inputs),
        ("qkv", layout.qkv),
        ("attn_output", layout.attn_output),
    ]
    problems = [
        f"{row} moves {before} to {after}, which name other dimensions (a row moves a tensor between "
        "placements: the same names, in the same order)"
        for row, (before, after) in pairs
        if before.names != after.names
    ]
    problems += [
        f"{row} splits over {', '.join(repr(a) for a in spec.axes if a != LAYOUT_AXIS)}: a layout's specs "
        f"split over {LAYOUT_AXIS!r} only (tensor parallelism is the tensor_parallel plan's)"
        for row, pair in pairs
        for spec in pair
        if any(axis != LAYOUT_AXIS for axis in spec.axes)
    ]
    if layout.logits != LOGITS:
        problems.append(f"logits={layout.logits}; a cp call gives the logits as {LOGITS} (the row states it)")
    return problems


def gathers_keys(module: nn.Module) -> bool:
    """Whether ``module`` is attention whose keys cp gathers whole: of a :data:`SPARSE_ATTENTION` class, and
    one of those of its class that select keys (:data:`SELECTING_WITH`)."""
    name = type(module).__name__
    attribute = SELECTING_WITH.get(name)
    return name in SPARSE_ATTENTION and (attribute is None or getattr(module, attribute, None) is not None)


def config_field(config, path: str):
    """``config``'s field at the dotted ``path`` (a sub-config's: BLT's global stack), None where missing."""
    try:
        return attrgetter(path)(config)
    except AttributeError:
        return None


def specs(before: str, after: str) -> tuple[Spec, Spec]:
    """A (before, after) pair of specs from their notation."""
    return Spec(before), Spec(after)


@dataclass(frozen=True)
class Layout:
    """The cp layout of one architecture. Specs come in (before, after) pairs; paths are module paths."""

    name: str
    #: the decoder (the model without its LM head) and its list of decoder layers
    decoder: str
    decoder_layers: str
    #: each decoder layer's attention module, which calls the attention function cp replaces (a layer that
    #: holds a recurrent mixer instead says so in ``recurrent``)
    attention: str
    #: the last module before the LM head: a sequence order other than contiguous is undone on its output
    final_norm: str
    #: config fields: the attention heads, the kv heads (None: as many as heads), the MLP width
    heads: str
    kv_heads: str | None
    mlp_width: str | None
    #: the residual stream, cut once at the first decoder layer (a slice: no communication); in a looped
    #: layout, at its first entry only
    hidden: tuple[Spec, Spec]
    #: q, k and v: sequence-split in, head-split out (one all-to-all for the three)
    qkv: tuple[Spec, Spec]
    #: the attention output, as transformers' attention functions return it: back to sequence-split
    attn_output: tuple[Spec, Spec]
    logits: Spec
    #: the model types whose layout this is
    model_types: tuple[str, ...] = ()
    #: per-layer inputs cut the same way at every layer (each layer may get its own rotary pair)
    layer_inputs: tuple[tuple[str, Spec, Spec], ...] = ()
    #: what the LM head does after its projection: config fields of :data:`HEAD_TRANSFORMS`
    head_transforms: tuple[str, ...] = ()
    #: the tensor-parallel plan: module path inside a decoder layer -> "colwise" (output features over
    #: ``tp``), "rowwise" (input features; the outputs are summed over ``tp``) or "per_head" (replicated,
    #: applied per head: each tp rank's heads add their share to the gradient)
    tensor_parallel: Mapping[str, str] = field(default_factory=dict, hash=False)
    #: where the replicated residual stream enters the column-wise layers: their input gradients sum over tp
    tensor_parallel_inputs: tuple[str, ...] = ()
    #: modules inside a decoder layer whose parameters hold one slice per expert on dim 0 (split over ``ep``)
    experts: tuple[str, ...] = ()
    #: parameters of the attention module with one entry per head on dim 0 (attention sinks): under
    #: Ulysses each rank's attention sees the entries of its own heads
    per_head_params: tuple[str, ...] = ()
    #: attention modules inside a decoder layer whose indexer selects keys per query (one of
    #: :data:`SPARSE_ATTENTION`): each rank's queries attend over keys gathered whole, not exchanged
    sparse_attention: tuple[str, ...] = ()
    #: the model's own loss reads ``labels`` as already shifted (BART's causal LMs): cp_forward then
    #: takes a batch's ``labels`` as its ``shift_labels``
    labels_shifted: bool = False
    #: the model's inputs beside the tokens that a batch may carry, whole on every rank and never padded
    #: (BLT's ``patch_lengths`` ``[B, P]``: precomputed patches, one integer per patch)
    whole_inputs: tuple[str, ...] = ()
    #: the field of the model's output with the logits ``[B, n, L, V]`` of its further prediction streams
    #: (ProphetNet's ``logits_ngram``), whose token losses join the logits' against the same labels: the loss
    #: is then the mean over every stream's tokens (:mod:`cpshard.loss.streams`)
    stream_logits: str | None = None
    #: the decoder reshapes its final hidden states to the input's length (GPT-2's ``view(output_shape)``):
    #: each rank's rows are given in a tensor of that length, and taken out again at the LM head
    restores_length: bool = False
    #: the decoder enters its layers more than once per forward (Dory's recurrent section): the stream is cut
    #: where it comes in whole, later entries take the slice on; the final norm runs between passes too, so
    #: the order stays contiguous (undone on its output, it would be undone mid-stream)
    looped: bool = False
    #: the decoder keeps per-position values of its own between its layers (Inkling2's block states, which
    #: each layer adds to; HRM's H and L states, :data:`ENTERED_DECODERS`): the sequence is cut where it
    #: enters the decoder (by its recurrent mixers' hooks, or the decoder's), so the decoder's own loop holds
    #: slices only, and its layers receive their inputs cut
    cut_at_entry: bool = False
    #: each decoder layer's MLP module (dense: token by token), which ``make_cp_forward(mlp_tile=N)`` runs
    #: a block of tokens at a time (:mod:`cpshard.runtime.tiled_mlp`)
    mlp: str | None = None
    #: the recurrent mixers some layers hold instead of attention (see :class:`Recurrent`)
    recurrent: tuple[Recurrent, ...] = ()
    #: class names of modules some layers hold at ``attention``'s path that work token by token (Nemotron-H's
    #: MLP and MoE layers): those layers hold neither attention nor a recurrent mixer
    pointwise: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "tensor_parallel", MappingProxyType(dict(self.tensor_parallel)))
        for row in ("hidden", "qkv", "attn_output"):  # notation given as strings reads as the specs it writes
            object.__setattr__(self, row, tuple(map(Spec, getattr(self, row))))
        object.__setattr__(self, "logits", Spec(self.logits))
        inputs = tuple((name, Spec(before), Spec(after)) for name, before, after in self.layer_inputs)
        object.__setattr__(self, "layer_inputs", inputs)
        problems = _spec_problems(self)
        if problems:
            raise ValueError(f"layout {self.name!r}: {'; '.join(problems)}")

    def __reduce__(self):
        """Pickled (to send to other ranks) with the plan as a plain dict: a mapping proxy does not pickle."""
        rows = {f.name: getattr(self, f.name) for f in fields(self)}
        return _from_rows, ({**rows, "tensor_parallel": dict(self.tensor_parallel)},)

    def with_rows(self, **changes) -> Layout:
        """A variant: ``changes`` replace rows; a mapping row (the tensor-parallel plan) is merged into
        this one's, so a file states only the modules in which it differs."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"Layout has no rows {sorted(unknown)}")
        if "tensor_parallel" in changes:
            changes["tensor_parallel"] = {**self.tensor_parallel, **changes["tensor_parallel"]}
        return replace(self, **changes)

    def for_types(self, name: str, *model_types: str) -> Layout:
        """This layout under another name, registered for ``model_types``."""
        return replace(self, name=name, model_types=model_types)

    @property
    def sizes_path(self) -> str:
        """Where the config that sizes the layout's layers sits in the model's: the sub-config its heads'
        dotted path names (BLT's ``global_config``, layers over a sequence of their own), else empty."""
        return self.heads.rpartition(".")[0]

    def sizes_config(self, config):
        """The config that sizes the layout's layers (:attr:`sizes_path`'s, else ``config`` itself)."""
        return attrgetter(self.sizes_path)(config) if self.sizes_path else config

    def head_counts(self, config) -> tuple[int, int]:
        """``(heads, kv heads)`` from ``config`` (kv heads = heads where the layout names no kv field)."""
        heads = attrgetter(self.heads)(config)  # a dotted path reads a sub-config (BLT's global stack)
        kv_heads = attrgetter(self.kv_heads)(config) if self.kv_heads else None
        return heads, heads if kv_heads is None else kv_heads

    @property
    def tp_splits_heads(self) -> bool:
        """Whether the tp plan splits the attention's heads (its projections column-wise); a plan that leaves
        attention whole (a derived plan without ``q_proj``: Phi-3's fused qkv, latent attention) runs every
        head on every tp rank."""
        return any(
            style == "colwise" and path.startswith(f"{self.attention}.")
            for path, style in self.tensor_parallel.items()
        )

    def tp_rank_head_counts(self, config, tp: int) -> tuple[int, int]:
        """``(heads, kv heads)`` one tp rank holds, which Ulysses splits over cp: a share of each where the tp
        plan splits them (:attr:`tp_splits_heads`; tp must divide both), else every head."""
        heads, kv_heads = self.head_counts(config)
        return (heads // tp, kv_heads // tp) if self.tp_splits_heads else (heads, kv_heads)


def attention_at(layer: nn.Module, path: str) -> list[nn.Module]:
    """The attention modules ``layer`` holds at ``path``: the module there, or each module of a list there
    (LongCat-Flash's layers run two attention sublayers, ``self_attn.0`` and ``self_attn.1``), so that what
    acts per attention module (recompute, per-head parameters, the byte counts) acts on each of them."""
    module = layer.get_submodule(path)
    return list(module) if isinstance(module, nn.ModuleList) else [module]


def _from_rows(rows: dict) -> Layout:
    return Layout(**rows)
