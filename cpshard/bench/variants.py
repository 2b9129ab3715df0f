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
MIB = 2**20
