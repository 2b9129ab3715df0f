"""``cpshard bench``: cpshard's implementations against one process and other Ulysses implementations.

For every cp size and sequence length, each rank builds the same model and batch and times one
training step (forward and backward, gradients summed) of every variant: cpshard's ``ulysses``,
``ring``, ``hybrid`` (where cp >= 4 fits), ``ulysses-blocked`` (``attention_block_bytes``),
``ulysses-nologits`` (``logits=False``), ``ulysses-checkpointed`` (that and the model's activation
checkpointing), the memory-lean rows (:data:`~cpshard.bench.variants.TILED`), ``cp1`` (cp_forward on
one rank, against the plain model), and the peers, run as their users run them: the Ulysses baselines of
:mod:`cpshard.bench.baselines` and DeepSpeed's ALST stack (:mod:`cpshard.bench.alst`). Variants
alternate round-robin inside each repeat, after a barrier, with a first round discarded (it counts
the bytes instead), so a noisy machine slows all alike. Per step and rank: wall time, peak resident
memory above the step's start, and the bytes put into collectives. The one-process baselines run on
every rank of the first cp group at once, with that group's threads per rank, so they are timed
under the same conditions.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from functools import cache

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cpshard.attention.choice import choose_implementation
from cpshard.bench.alst import alst_step
from cpshard.bench.baselines import CollectiveCounter, barrier, missing, peer_step, plain_step
from cpshard.bench.config import BenchConfig
from cpshard.bench.report import (
    Row,
    add_ratios,
    against_alst,
    format_table,
    longest_within_budget,
    targets,
)
from cpshard.bench.variants import CHECKPOINTED, CPSHARD, MIB, ONE_PROCESS, TILED
from cpshard.comm.record import recording
from cpshard.debug.optimum import optimum_for
from cpshard.parallel.mesh import make_mesh
from cpshard.parallel.processes import LocalRanks
from cpshard.runtime.forward import make_cp_forward, params_of
from cpshard.runtime.grad import value_and_grad
from cpshard.tools.memory import LiveTensors, current_rss, peak_rss, reset_peak_rss
from cpshard.tools.tiny import tiny_batch, tiny_model


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
    """The memory modes of a variant in :data:`TILED`: ``mlp_tile`` (the hidden size),
    ``attention_recompute`` and ``attention_block_bytes``."""
    if variant not in TILED:
        return {}
    tile = model.config.hidden_size
    return dict(mlp_tile=tile, attention_recompute=True, attention_block_bytes=1 << 26)


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
