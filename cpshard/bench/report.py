"""What ``cpshard bench`` makes of its measurements: the rows, their ratios round by round, the table,
issue 18's targets and the comparison with ALST, the longest L within a budget, JSON and a plot."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

from cpshard.bench.config import BenchConfig
from cpshard.bench.variants import JUDGED, PEERS, VARIANTS
from cpshard.debug.table import grouped, table_of


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


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


#: the columns every bench table starts with: which variant, on how many ranks, at which length
STEP_COLUMNS = (("variant", lambda r: r.variant), ("cp", lambda r: r.cp), ("L", lambda r: r.seq))

# fmt: off
_COLUMNS = (
    *STEP_COLUMNS,
    ("median ms", lambda r: f"{r.seconds * 1e3:.0f}"),
    ("tokens/s", lambda r: f"{r.tokens_per_second:.0f}"),   ("vs peer", lambda r: _ratio(r.time_ratio)),
    ("cpu ms", lambda r: f"{r.cpu_seconds * 1e3:.0f}"),     ("vs peer", lambda r: _ratio(r.cpu_ratio)),
    ("peak MiB/rank", lambda r: f"{r.peak_mib:.0f}"),       ("vs 1 proc", lambda r: _ratio(r.memory_ratio)),
    ("RSS MiB", lambda r: "-" if r.rss_mib is None else f"{r.rss_mib:.0f}"),
    ("bytes/rank", lambda r: grouped(r.bytes_sent)),
    ("optimum", lambda r: grouped(r.optimum) if r.optimum else "-"),
    ("recv/rank", lambda r: grouped(r.bytes_received)),
    ("collectives", lambda r: ", ".join(op for op in r.bytes_by_op if op != "counted")),
)
# fmt: on


def format_table(rows: list[Row]) -> str:
    ordered = sorted(rows, key=lambda r: (r.seq, r.cp, VARIANTS.index(r.variant)))
    return table_of(ordered, _COLUMNS, text=frozenset({"variant", "collectives"}))


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
