"""``cpshard bench``: cpshard's implementations against one process and other Ulysses implementations.

For every cp size and sequence length, each rank builds the same model and batch and times one
training step (forward and backward, gradients summed) of every variant: cpshard's ``ulysses``,
``ring``, ``hybrid`` (where cp >= 4 fits), ``ulysses-nologits`` (``logits=False``) and
``ulysses-checkpointed`` (that and the model's activation checkpointing), ``cp1`` (cp_forward on one
rank, against the plain model), and the peers, run as their users run them: the Ulysses baselines of
:mod:`cpshard.tools.baselines` and DeepSpeed's ALST stack (:mod:`cpshard.tools.alst`). Variants
alternate round-robin inside each repeat, after a barrier, with a first round discarded (it counts
the bytes instead), so a noisy machine slows all alike. Per step and rank: wall time, peak resident
memory above the step's start, and the bytes put into collectives. The one-process baselines run on
every rank of the first cp group at once, with that group's threads per rank, so they are timed
under the same conditions.
"""

from __future__ import annotations

import ctypes
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import cache

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cpshard.attention.choice import choose_implementation
from cpshard.comm.record import recording
from cpshard.debug.optimum import optimum_for
from cpshard.debug.table import grouped, table
from cpshard.layouts.registry import resolve_layout
from cpshard.parallel.mesh import make_mesh
from cpshard.parallel.processes import LocalRanks
from cpshard.runtime.forward import make_cp_forward, params_of
from cpshard.runtime.grad import value_and_grad
from cpshard.tools.alst import alst_step
from cpshard.tools.baselines import CollectiveCounter, barrier, missing, peer_step, plain_step
from cpshard.tools.memory import LiveTensors, current_rss, peak_rss, reset_peak_rss
from cpshard.tools.tiny import tiny_batch, tiny_model
from cpshard.tools.usage import UsageError, llama_sizes

#: cpshard's variants and their make_cp_forward options
CPSHARD = {
    "ulysses": dict(implementation="ulysses"),
    "ring": dict(implementation="ring"),
    "hybrid": dict(implementation="hybrid"),
    "ulysses-nologits": dict(implementation="ulysses", logits=False),
    "ulysses-checkpointed": dict(implementation="ulysses", logits=False),
    "ulysses-lean": dict(implementation="ulysses"),
    "ulysses-lean-nologits": dict(implementation="ulysses", logits=False),
}
#: variants whose model recomputes each decoder layer in the backward (transformers' activation checkpointing)
CHECKPOINTED = ("ulysses-checkpointed", "ulysses-lean", "ulysses-lean-nologits")
#: variants that also run the MLP in blocks of as many tokens as the hidden size (the layout's ``mlp_tile``;
#: ALST's TiledMLP example cuts as many) and recompute the attention apart: the memory-lean configuration
TILED = ("ulysses-lean", "ulysses-lean-nologits")
#: the variants whose memory the targets judge
JUDGED = ("ulysses", "ulysses-nologits", "ulysses-checkpointed", *TILED)
#: the Ulysses implementations cpshard is timed against ("peers"), and one process without cp
PEERS = ("dtensor", "deepspeed", "yunchang", "alst")
#: on one process each: the plain model, and cpshard's cp_forward at cp=1 (its overhead over the plain model)
ONE_PROCESS = ("single", "cp1")
VARIANTS = (*ONE_PROCESS, *CPSHARD, *PEERS)
MIB = 2**20
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


def _implementation(variant: str) -> str:
    """cpshard's implementation of a variant; the peers (and cp=1) are Ulysses, and fit where it does."""
    return CPSHARD.get(variant, CPSHARD["ulysses"])["implementation"]


def fits(variant: str, cp: int, heads: int) -> bool:
    """Whether ``variant`` can run ``heads`` heads over ``cp`` ranks (Ulysses splits the heads)."""
    try:
        choose_implementation(_implementation(variant), heads, cp)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- what each rank runs


def _idle(params, batch, mesh):
    return None


@cache
def _own_mesh(rank: int, world: int):
    """A cp mesh of this rank alone (every rank makes every rank's group, as new_group wants)."""
    groups = [dist.new_group([r]) for r in range(world)]
    return DeviceMesh.from_group(groups[rank], "cpu", mesh_dim_names=("cp",))


def _on_own_mesh(step):
    own = _own_mesh(dist.get_rank(), dist.get_world_size())
    return lambda params, batch, mesh: step(params, batch, own)


def _steps(model_of, variants: tuple[str, ...], idle_single: bool) -> tuple[dict, list[str]]:
    """Each variant's ``step(params, batch, mesh)``; a note for each baseline that cannot run here."""
    steps, notes, model = {}, [], model_of()
    for name in variants:
        if name == "single":
            steps[name] = (
                _idle if idle_single else plain_step(model)
            )  # cpshard's attention steps aside outside a cp call
        elif name == "cp1":  # every rank makes the one-rank groups, then the idle ones wait
            step = _on_own_mesh(value_and_grad(make_cp_forward(model)))
            steps[name] = _idle if idle_single else step
        elif name in CPSHARD:
            owner = _checkpointed(model_of()) if name in CHECKPOINTED else model
            steps[name] = value_and_grad(make_cp_forward(owner, **CPSHARD[name], **_tiled(name, owner)))
        elif (note := missing(name)) is not None:
            notes.append(note)
        elif name == "alst":
            steps[name] = alst_step(model_of())
        else:
            steps[name] = peer_step(name, model_of())  # its own copy: its attention function differs
    return steps, notes


def _checkpointed(model):
    model.activation_checkpointing_enable()
    return model.train()


def _tiled(variant: str, model) -> dict:
    """The layout option of a variant in :data:`TILED`: the model's own with ``mlp_tile`` and
    ``attention_recompute`` set."""
    if variant not in TILED:
        return {}
    tile = model.config.hidden_size
    return dict(layout=resolve_layout(model).with_rows(mlp_tile=tile, attention_recompute=True))


def _release_memory() -> None:
    """Give freed memory back to the system, so that each step's peak starts from what is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _timed(step, params: dict, batch: dict, mesh) -> tuple[float, float, int]:
    """One step after a barrier: its wall time, this process's CPU time (all its threads; other
    processes' load hardly changes it) and its peak resident memory above its start."""
    _release_memory()
    barrier()
    reset_peak_rss()
    before = current_rss()
    start, cpu = time.perf_counter(), time.process_time()
    result = step(params, batch, mesh)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    growth = peak_rss() - before
    del result
    return seconds, cpu, growth


def rank_job(config: BenchConfig, seq: int, variants: tuple[str, ...]) -> dict:
    """On every rank: the variants' step times, memory growths and bytes by collective."""
    mesh = make_mesh(cp=dist.get_world_size())
    model_of = lambda: tiny_model("llama", seed=config.seed, **config.model_sizes())  # noqa: E731
    steps, notes = _steps(model_of, variants, config.single_rank0_only and dist.get_rank() != 0)
    params, batch = params_of(model_of()), tiny_batch(config.vocab, 1, seq, seed=config.seed)
    times, cpus, growths = ({name: [] for name in steps} for _ in range(3))
    counted, recorded, live = {}, {}, {}
    for name, step in steps.items():  # warm-up round, discarded: it counts the bytes instead
        barrier()
        with CollectiveCounter() as counter, recording() as log:
            step(params, batch, mesh)
        counted[name], recorded[name] = counter.summary(), log.bytes_by("op")
    for name, step in steps.items():  # an untimed round counts the peak of live tensors
        _release_memory()
        barrier()
        with LiveTensors() as tensors:
            step(params, batch, mesh)
        live[name] = tensors.peak
    for _ in range(config.repeats):
        for name, step in steps.items():
            seconds, cpu, growth = _timed(step, params, batch, mesh)
            times[name].append(seconds)
            cpus[name].append(cpu)
            growths[name].append(growth)
    return dict(
        times=times, cpus=cpus, growths=growths, live=live, counted=counted, recorded=recorded, notes=notes
    )


# ---------------------------------------------------------------- what the parent makes of it


@dataclass
class Row:
    """One variant at one (cp, L): medians over the repeats of the slowest rank's step."""

    variant: str
    cp: int
    seq: int
    seconds: float
    #: the busiest rank's CPU seconds (all its threads): what the step costs, whatever else runs
    cpu_seconds: float
    #: the peak of the tensors the step allocates (as torch.cuda.max_memory_allocated counts on a GPU)
    peak_mib: float
    #: bytes this rank passes into collectives per step (input sizes), and what it receives
    bytes_sent: int
    bytes_received: int
    bytes_by_op: dict
    #: the analytic optimum of the bytes sent (cpshard.debug.optimum; Ulysses' for the Ulysses peers)
    optimum: int | None = None
    time_ratio: float | None = None
    cpu_ratio: float | None = None
    memory_ratio: float | None = None
    #: per round (repeat): the slowest rank's wall seconds and the busiest rank's CPU seconds
    step_seconds: list = field(default_factory=list)
    step_cpu_seconds: list = field(default_factory=list)
    #: the peak resident memory the step adds (median over the rounds), glibc's kept heap included
    rss_mib: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.seq / self.seconds


def _optimum(variant: str, model, seq: int, cp: int) -> int | None:
    return None if variant in ONE_PROCESS else optimum_for(model, 1, seq, cp, _implementation(variant)).total


def _rows(results: list[dict], config: BenchConfig, seq: int) -> list[Row]:
    """One row per variant from every rank's results (times: slowest rank; memory: largest rank)."""
    model, cp, first = tiny_model("llama", seed=config.seed, **config.model_sizes()), len(results), results[0]
    rows = []
    for name in first["times"]:
        slowest = [max(r["times"][name][i] for r in results) for i in range(config.repeats)]
        busiest = [max(r["cpus"][name][i] for r in results) for i in range(config.repeats)]
        growth = max(statistics.median(r["growths"][name]) for r in results)
        live = max(r["live"][name] for r in results)
        sent, received, by_op = first["counted"][name]
        if name in CPSHARD:  # cpshard's own record of its collectives (the counter agrees; see the json)
            by_op = {**first["recorded"][name], "counted": sent}
            sent = sum(first["recorded"][name].values())
        seconds, variant_cp = statistics.median(slowest), 1 if name in ONE_PROCESS else cp
        optimum = _optimum(name, model, seq, cp)
        rows.append(
            Row(
                name,
                variant_cp,
                seq,
                seconds,
                statistics.median(busiest),
                live / MIB,
                sent,
                received,
                by_op,
                optimum,
                step_seconds=slowest,
                step_cpu_seconds=busiest,
                rss_mib=growth / MIB,
            )
        )
    return rows


def measure(
    ranks: LocalRanks, config: BenchConfig, seq: int, single: bool = True
) -> tuple[list[Row], list[str]]:
    """Rows of every variant that fits these ranks at length ``seq``; notes on what could not run."""
    cp = ranks.nprocs
    skipped = [v for v in config.variants if v not in ONE_PROCESS and not fits(v, cp, config.heads)]
    variants = tuple(v for v in config.variants if v not in skipped and (v not in ONE_PROCESS or single))
    results = ranks.run(rank_job, config, seq, variants)
    notes = (
        [f"cp={cp}: {', '.join(skipped)} cannot split {config.heads} heads (hybrid needs cp >= 4)"]
        if skipped
        else []
    )
    return _rows(results, config, seq), notes + results[0]["notes"]


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over rounds of ``ours / theirs`` within each round: the variants of a round run back to
    back, so a slow spell of a shared machine slows both sides of the ratio alike and drops out."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def add_ratios(rows: list[Row]) -> None:
    """Time against the fastest peer at the same (cp, L) (the one with the least median), round by round,
    and cp=1 against the plain model; peak memory against one process at the same L."""
    for row in rows:
        peers = [r for r in rows if r.variant in PEERS and (r.cp, r.seq) == (row.cp, row.seq)]
        single = [r for r in rows if r.variant == "single" and r.seq == row.seq]
        if row.variant == "cp1":
            peers = single
        if peers and row.variant != "single":
            fastest, least = min(peers, key=lambda r: r.seconds), min(peers, key=lambda r: r.cpu_seconds)
            row.time_ratio = paired_ratio(row.step_seconds, fastest.step_seconds)
            row.cpu_ratio = paired_ratio(row.step_cpu_seconds, least.step_cpu_seconds)
        row.memory_ratio = row.peak_mib / single[0].peak_mib if single and single[0].peak_mib > 0 else None


def run_bench(config: BenchConfig, out=print) -> list[Row]:
    """Measure every (cp, L) on fresh local ranks, print the table, the notes and the targets; the rows."""
    rows, notes = [], []
    for index, cp in enumerate(config.cps):
        out(f"  starting {cp} ranks ...", flush=True)
        with LocalRanks(cp, timeout=3600) as ranks:
            for seq in config.seqs:
                start = time.perf_counter()
                found, said = measure(ranks, config, seq, single=index == 0)
                rows += found
                notes += [note for note in said if note not in notes]
                out(
                    f"  cp={cp} L={seq}: {len(found)} variants in {time.perf_counter() - start:.0f} s",
                    flush=True,
                )
    add_ratios(rows)
    out("\n" + format_table(rows))
    budget = longest_within_budget(rows) + longest_within_budget(rows, config.budget_mib)
    out("\n".join(["", *notes, *targets(rows), *against_alst(rows, config.budget_mib), *budget]))
    return rows


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(rows: list[Row]) -> str:
    header = (
        "variant",
        "cp",
        "L",
        "median ms",
        "tokens/s",
        "vs peer",
        "cpu ms",
        "vs peer",
        "peak MiB/rank",
        "vs 1 proc",
        "RSS MiB",
        "bytes/rank",
        "optimum",
        "recv/rank",
        "collectives",
    )
    cells = [
        (
            r.variant,
            r.cp,
            r.seq,
            f"{r.seconds * 1e3:.0f}",
            f"{r.tokens_per_second:.0f}",
            _ratio(r.time_ratio),
            f"{r.cpu_seconds * 1e3:.0f}",
            _ratio(r.cpu_ratio),
            f"{r.peak_mib:.0f}",
            _ratio(r.memory_ratio),
            "-" if r.rss_mib is None else f"{r.rss_mib:.0f}",
            grouped(r.bytes_sent),
            grouped(r.optimum) if r.optimum else "-",
            grouped(r.bytes_received),
            ", ".join(op for op in r.bytes_by_op if op != "counted"),
        )
        for r in sorted(rows, key=lambda r: (r.seq, r.cp, VARIANTS.index(r.variant)))
    ]
    return table(cells, header, right=frozenset(range(1, 14)))


def _verdict(ratio: float, want: float) -> str:
    return f"{ratio:.3f} (target <= {want:.2f}): {'met' if ratio <= want else 'MISSED'}"


def targets(rows: list[Row]) -> list[str]:
    """Issue 18's targets, each with its numbers: Ulysses' step against the fastest peer at the shortest and
    the longest L (CPU time, which other load hardly moves; the wall clock's ratio beside it), cp=1 against
    the plain model, and Ulysses' memory against one process at the longest L."""
    lines = ["", "targets:"]
    seqs = sorted({r.seq for r in rows})
    by = {(r.variant, r.cp, r.seq): r for r in rows}
    for seq in seqs:
        row = by.get(("cp1", 1, seq))
        if row is not None and row.cpu_ratio is not None:
            lines.append(
                f"  cp=1, L={seq}: cp_forward's CPU time x the plain model's "
                f"{_verdict(row.cpu_ratio, 1.02)}; wall {row.time_ratio:.3f} x"
            )
    for cp in sorted({r.cp for r in rows if r.cp > 1}):
        for seq, want in {seqs[-1]: 0.90, seqs[0]: 0.95}.items():  # one length: the shorter's target
            row = by.get(("ulysses", cp, seq))
            if row is not None and row.cpu_ratio is not None:
                lines.append(
                    f"  time, cp={cp}, L={seq}: cpshard ulysses' CPU time x the least peer's "
                    f"{_verdict(row.cpu_ratio, want)}; wall {row.seconds * 1e3:.0f} ms = "
                    f"{row.time_ratio:.3f} x the fastest peer's (noisy on a shared machine)"
                )
        for variant in JUDGED:
            row = by.get((variant, cp, seqs[-1]))
            if row is not None and row.memory_ratio is not None:
                lines.append(
                    f"  memory, cp={cp}, L={seqs[-1]}, {variant}: {row.peak_mib:.0f} MiB/rank, x one "
                    f"process's {_verdict(row.memory_ratio, 0.45)}"
                )
    return lines


def longest_within_budget(rows: list[Row], budget_mib: float | None = None) -> list[str]:
    """The longest L each variant fits in ``budget_mib`` per rank (default: one process's peak at the
    longest L measured): peak memory is fitted as a + b * L through the two longest lengths measured
    (linear: no L x L buffers)."""
    seqs = sorted({r.seq for r in rows})
    by = {(r.variant, r.cp, r.seq): r for r in rows}
    single = by.get(("single", 1, seqs[-1]))
    if len(seqs) < 2 or (single is None and budget_mib is None):
        return []
    if budget_mib is None:
        budget, what = single.peak_mib, f"one process's peak at L={seqs[-1]}"
    else:
        budget, what = budget_mib, "the budget"
    lines = [
        f"  longest L within {budget:.0f} MiB per rank ({what}), fitted through L={seqs[-2]} and {seqs[-1]}:"
    ]
    for (variant, cp), fits in longest_lengths(rows, budget).items():
        lines.append(f"    {variant} (cp={cp}): L = {fits:.0f}, {fits / seqs[-1]:.2f} x")
    return lines


def longest_lengths(rows: list[Row], budget_mib: float) -> dict[tuple[str, int], float]:
    """(variant, cp) -> the longest L whose fitted step memory per rank is within ``budget_mib``."""
    seqs = sorted({r.seq for r in rows})
    by = {(r.variant, r.cp, r.seq): r for r in rows}
    result = {}
    for variant, cp in sorted({(r.variant, r.cp) for r in rows}, key=lambda k: (k[1], VARIANTS.index(k[0]))):
        short, long = by.get((variant, cp, seqs[-2])), by.get((variant, cp, seqs[-1]))
        if short is None or long is None or long.peak_mib <= short.peak_mib:
            continue
        slope = (long.peak_mib - short.peak_mib) / (seqs[-1] - seqs[-2])
        result[variant, cp] = seqs[-1] + (budget_mib - long.peak_mib) / slope
    return result


def against_alst(rows: list[Row], budget_mib: float) -> list[str]:
    """cpshard's Ulysses variants against ALST: the longest L within the budget (target >= 1.5x ALST's)
    and the CPU time of a step at the longest L measured (target <= ALST's)."""
    seqs = sorted({r.seq for r in rows})
    by = {(r.variant, r.cp, r.seq): r for r in rows}
    longest = longest_lengths(rows, budget_mib) if len(seqs) > 1 else {}
    lines = []
    for cp in sorted({r.cp for r in rows if r.cp > 1}):
        alst = by.get(("alst", cp, seqs[-1]))
        if alst is None:
            continue
        for variant in JUDGED:
            row = by.get((variant, cp, seqs[-1]))
            if row is None:
                continue
            time = paired_ratio(row.step_cpu_seconds, alst.step_cpu_seconds)
            line = (
                f"  against ALST, cp={cp}, {variant}: CPU time at L={seqs[-1]} x ALST's {_verdict(time, 1.0)}"
            )
            if (variant, cp) in longest and ("alst", cp) in longest:
                ratio = longest[variant, cp] / longest["alst", cp]
                line += f"; longest L within {budget_mib:.0f} MiB x ALST's {ratio:.2f} (target >= 1.50): "
                line += "met" if ratio >= 1.5 else "MISSED"
            lines.append(line)
    return lines


def write_json(rows: list[Row], config: BenchConfig, path: str) -> None:
    with open(path, "w") as f:
        rows = [{**asdict(r), "tokens_per_second": r.tokens_per_second} for r in rows]
        json.dump({"config": asdict(config), "rows": rows}, f, indent=1)


def plot(rows: list[Row], path: str) -> None:
    """CPU time per step and peak memory per rank against the sequence length, one line per variant and cp
    (CPU time: the wall clock of a shared machine moves with its other load)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in sorted({(r.variant, r.cp) for r in rows}, key=lambda k: (k[1], VARIANTS.index(k[0]))):
        line = sorted((r for r in rows if (r.variant, r.cp) == key), key=lambda r: r.seq)
        label = f"{key[0]} (cp={key[1]})"
        times.plot([r.seq for r in line], [r.cpu_seconds for r in line], marker="o", label=label)
        memory.plot([r.seq for r in line], [r.peak_mib for r in line], marker="o", label=label)
    for axes, ylabel in ((times, "CPU time per step and rank (s)"), (memory, "peak memory per rank (MiB)")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("sequence length (tokens)")
        axes.set_ylabel(ylabel)
        axes.grid(True, which="both", alpha=0.3)
    times.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
