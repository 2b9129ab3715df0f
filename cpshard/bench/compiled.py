"""``cpshard bench --compile``: each cpshard variant's training step compiled against the same step eager.

On local CPU ranks, per variant (``make_cp_forward`` options of
:data:`cpshard.bench.variants.CPSHARD`), two copies of one model with the same weights: one eager,
one whose decoder layers are compiled
(``make_cp_forward(model, compile=backend)``; a copy of its own, since compiling changes the model's
layers in place, and an "eager" step over them would run them compiled). Per length, the first compiled
call (tracing and code generation, or a recompile) is timed apart; then ``repeats`` rounds alternate one
eager and one compiled step, each between barriers, and the ratios are taken round by round. The graphs
compiled and the graph breaks are torch's own counters; the compiled loss is checked against eager's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from cpshard.bench.config import BenchConfig
from cpshard.bench.measure import fits
from cpshard.bench.report import STEP_COLUMNS, paired_ratio
from cpshard.bench.variants import CHECKPOINTED, CPSHARD
from cpshard.debug.table import table_of
from cpshard.parallel.mesh import make_mesh
from cpshard.parallel.processes import LocalRanks
from cpshard.runtime.forward import make_cp_forward, params_of
from cpshard.runtime.grad import value_and_grad
from cpshard.tools.tiny import tiny_batch, tiny_model
from cpshard.tools.usage import UsageError


def check_backend(backend: str) -> None:
    """A usage error unless ``backend`` names a torch.compile backend."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise UsageError(
            f"--compile {backend}: not a torch.compile backend (such as inductor, aot_eager or eager; "
            "torch._dynamo.list_backends() lists them)"
        )


def compiled_variants(config: BenchConfig, cp: int) -> tuple[str, ...]:
    """The cpshard variants among ``config.variants`` that run on ``cp`` ranks and compile (the peers never
    do; nor do checkpointed blocks of queries: ``attention_block_bytes``)."""
    return tuple(
        v
        for v in config.variants
        if v in CPSHARD and fits(v, cp, config.heads) and "attention_block_bytes" not in CPSHARD[v]
    )


def _step(step, params, batch, mesh) -> tuple[float, float, float]:
    """``(wall s, CPU s, loss)`` of one step, between barriers."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    out, _ = step(params, batch, mesh)
    dist.barrier()
    return time.perf_counter() - start, time.process_time() - cpu, out.loss.item()


def _model(config: BenchConfig, checkpointed: bool = False):
    model = tiny_model("llama", seed=config.seed, **config.model_sizes())
    if checkpointed:
        model.activation_checkpointing_enable()
    return model.train()


def rank_job(config: BenchConfig, variants: tuple[str, ...], backend: str) -> dict:
    """On every rank, per variant and length: the first compiled call, each round's eager and compiled
    steps, the graphs and graph breaks counted over the length's compiled calls, and both losses."""
    mesh = make_mesh(cp=dist.get_world_size())
    params, results = params_of(_model(config)), {}
    for variant in variants:
        torch._dynamo.reset()  # each variant compiles from nothing: no other's graphs, guards or limits
        checkpointed, options = variant in CHECKPOINTED, CPSHARD[variant]
        eager = value_and_grad(make_cp_forward(_model(config, checkpointed), **options))
        compiled = value_and_grad(make_cp_forward(_model(config, checkpointed), compile=backend, **options))
        for seq in config.seqs:
            batch = tiny_batch(config.vocab, 1, seq, seed=config.seed)
            _step(eager, params, batch, mesh)  # warm-up: allocator, first collectives
            counters.clear()
            first = _step(compiled, params, batch, mesh)
            rounds = [
                (_step(eager, params, batch, mesh), _step(compiled, params, batch, mesh))
                for _ in range(config.repeats)
            ]
            results[variant, seq] = dict(
                first=first,
                rounds=rounds,
                graphs=counters["stats"]["unique_graphs"],
                breaks=sum(counters["graph_break"].values()),
            )
    return results


@dataclass
class CompiledRow:
    """One variant at one (cp, L): the slowest rank's wall seconds and the busiest rank's CPU seconds."""

    variant: str
    cp: int
    seq: int
    #: the first compiled call at this length (compiling, or recompiling for a new length)
    compile_seconds: float
    #: medians over the rounds
    eager_seconds: float
    compiled_seconds: float
    #: compiled / eager, round by round (the median over rounds)
    time_ratio: float
    cpu_ratio: float
    graphs: int
    breaks: int
    #: |compiled loss - eager loss| in the last round
    loss_diff: float


def _row(per_rank: list[dict], key: tuple[str, int], cp: int) -> CompiledRow:
    runs = [r[key] for r in per_rank]
    rounds = range(len(runs[0]["rounds"]))

    def slowest(side: int, field: int) -> list[float]:
        return [max(run["rounds"][i][side][field] for run in runs) for i in rounds]

    eager, compiled = slowest(0, 0), slowest(1, 0)
    last = runs[0]["rounds"][-1]
    return CompiledRow(
        key[0],
        cp,
        key[1],
        max(run["first"][0] for run in runs),
        statistics.median(eager),
        statistics.median(compiled),
        paired_ratio(compiled, eager),
        paired_ratio(slowest(1, 1), slowest(0, 1)),
        max(run["graphs"] for run in runs),
        max(run["breaks"] for run in runs),
        abs(last[1][2] - last[0][2]),
    )


def measure(ranks: LocalRanks, config: BenchConfig, backend: str) -> list[CompiledRow]:
    """Rows of every cpshard variant among ``config.variants`` that fits these ranks, at every length."""
    variants = compiled_variants(config, ranks.nprocs)
    per_rank = ranks.run(rank_job, config, variants, backend)
    return [_row(per_rank, key, ranks.nprocs) for key in per_rank[0]]


# fmt: off
_COLUMNS = (
    *STEP_COLUMNS,
    ("first compiled call s", lambda r: f"{r.compile_seconds:.1f}"),
    ("eager ms", lambda r: f"{r.eager_seconds * 1e3:.0f}"),
    ("compiled ms", lambda r: f"{r.compiled_seconds * 1e3:.0f}"),
    ("compiled/eager", lambda r: f"{r.time_ratio:.2f}"),
    ("cpu compiled/eager", lambda r: f"{r.cpu_ratio:.2f}"),
    ("graphs", lambda r: r.graphs),  ("breaks", lambda r: r.breaks),
    ("loss diff", lambda r: f"{r.loss_diff:.1e}"),
)
# fmt: on


def format_table(rows: list[CompiledRow]) -> str:
    return table_of(rows, _COLUMNS, text=frozenset({"variant"}))


def run_compiled_bench(config: BenchConfig, backend: str, out=print) -> list[CompiledRow]:
    """Compiled against eager steps on fresh local ranks for every cp size; print the table; the rows."""
    rows = []
    for cp in config.cps:
        if not compiled_variants(config, cp):
            out(f"  --compile: no cpshard variant among --variants runs at cp={cp}")
            continue
        out(f"  compiling on {cp} ranks ({backend}) ...", flush=True)
        with LocalRanks(cp, timeout=3600) as ranks:
            rows += measure(ranks, config, backend)
    out(
        f"\ncompiled ({backend}) against eager cp steps, step times of the slowest rank:\n"
        + format_table(rows)
    )
    return rows
