"""The variants ``cpshard bench`` measures, by name: cpshard's (with their make_cp_forward options), the
peers, and one process; the measuring (:mod:`cpshard.bench.measure`) and the judging
(:mod:`cpshard.bench.report`) both read them."""

#: cpshard's variants and their make_cp_forward options
CPSHARD = {
    "ulysses": dict(implementation="ulysses"),
    "ring": dict(implementation="ring"),
    "hybrid": dict(implementation="hybrid"),
    "ulysses-blocked": dict(implementation="ulysses", attention_block_bytes=1 << 26),
    "ulysses-nologits": dict(implementation="ulysses", logits=False),
    "ulysses-checkpointed": dict(implementation="ulysses", logits=False),
    "ulysses-lean": dict(implementation="ulysses"),
    "ulysses-lean-nologits": dict(implementation="ulysses", logits=False),
}
#: variants whose model recomputes each decoder layer in the backward (transformers' activation checkpointing)
CHECKPOINTED = ("ulysses-checkpointed", "ulysses-lean", "ulysses-lean-nologits")
#: variants that also run the MLP in blocks of as many tokens as the hidden size (``mlp_tile``;
#: ALST's TiledMLP example cuts as many), recompute the attention apart and run it in checkpointed blocks of
#: queries (``attention_block_bytes``, 64 MiB of scores): the memory-lean configuration
TILED = ("ulysses-lean", "ulysses-lean-nologits")
#: the variants whose memory the targets judge
JUDGED = ("ulysses", "ulysses-blocked", "ulysses-nologits", "ulysses-checkpointed", *TILED)
#: the Ulysses implementations cpshard is timed against ("peers"), and one process without cp
PEERS = ("dtensor", "deepspeed", "yunchang", "alst")
#: on one process each: the plain model, and cpshard's cp_forward at cp=1 (its overhead over the plain model)
ONE_PROCESS = ("single", "cp1")
VARIANTS = (*ONE_PROCESS, *CPSHARD, *PEERS)
#: what each variant is, as ``cpshard bench --help`` says it
# fmt: off
MEANINGS = {
    "single": "the plain model on one process",  "cp1": "cp_forward at cp=1 (its overhead)",
    "ulysses": "cpshard's default",  "ring": "ring attention",
    "hybrid": "Ulysses within ring groups (cp >= 4)",
    "ulysses-blocked": "attention in checkpointed query blocks of 64 MiB of scores",
    "ulysses-nologits": "the loss without the logits (logits=False)",
    "ulysses-checkpointed": "nologits with every decoder layer recomputed in the backward",
    "ulysses-lean": "every layer recomputed, the MLP tiled, the attention in blocks (the memory frontier)",
    "ulysses-lean-nologits": "lean without the logits",
    "dtensor": "Ulysses by DTensor's redistribute",  "deepspeed": "DeepSpeed's DistributedAttention",
    "yunchang": "yunchang's SeqAllToAll4D",
    "alst": "DeepSpeed's ALST stack (UlyssesSPAttentionHF, the tiled MLP and loss)",
}
# fmt: on
MIB = 2**20
