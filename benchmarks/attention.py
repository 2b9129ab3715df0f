"""Ulysses, ring and hybrid side by side, and what head-tail order does for ring's balance.

    python benchmarks/attention.py --seqs 1024 2048 4096 --nprocs 2 4 --repeats 3
    python benchmarks/attention.py --packed 20 --seqs 16384 --nprocs 4 --repeats 3

For each rank count and length: the median training-step time of every implementation that
fits (alternated in one run, so a noisy machine slows all alike; read the ratios), the bytes
each rank sends per step against the analytic optimum, and, for ring, the attention compute of
each rank alone (max/min over ranks) with contiguous and with head-tail order. ``--packed ROWS``: on rows
packing documents instead (:mod:`cpshard.bench.packed`, also ``cpshard bench --packed ROWS``).
"""

import argparse
import statistics
import time

import torch

import cpshard
from cpshard.bench.packed import packed_report, ring_compute_per_rank
from cpshard.comm.record import recording
from cpshard.debug.optimum import optimum_for
from cpshard.tools.tiny import tiny_batch, tiny_model

MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=1024,
)
VARIANTS = {
    "ulysses": dict(implementation="ulysses"),
    "ring": dict(implementation="ring", sequence_order="head_tail"),
    "ring-contiguous": dict(implementation="ring", sequence_order="contiguous"),
    "hybrid": dict(implementation="hybrid"),
}


def fits(variant: str, cp: int) -> bool:
    return variant != "hybrid" or cp >= 4


def step_times(seq: int, repeats: int):
    """On every rank: median step time and bytes per step of each variant."""
    cp = torch.distributed.get_world_size()
    model = tiny_model("llama", **MODEL)
    batch = tiny_batch(model.config.vocab_size, 1, seq)
    mesh, params = cpshard.make_mesh(cp=cp), cpshard.params_of(model)
    steps = {
        name: cpshard.value_and_grad(cpshard.make_cp_forward(model, **options))
        for name, options in VARIANTS.items()
        if fits(name, cp)
    }
    times, sent = {name: [] for name in steps}, {}
    for repeat in range(repeats + 1):
        for name, step in steps.items():
            torch.distributed.barrier()
            with recording() as log:
                start = time.perf_counter()
                step(params, batch, mesh)
                elapsed = time.perf_counter() - start
            if repeat:  # the first round warms up
                times[name].append(elapsed)
            sent[name] = log.bytes_by("op")
    return {name: statistics.median(values) for name, values in times.items()}, sent


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--packed", type=int, metavar="ROWS", help="ring work on packed documents instead, over ROWS rows"
    )
    args = parser.parse_args()
    if args.packed:
        packed_report(args.seqs, args.nprocs, args.repeats, args.packed)
        return
    print("| ranks | L | variant | step s | vs ulysses | bytes/step/rank | optimum | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for nprocs in args.nprocs:
        with cpshard.LocalRanks(nprocs) as ranks:
            for seq in args.seqs:
                results = ranks.run(step_times, seq, args.repeats)
                medians, sent = results[0]
                model = tiny_model("llama", **MODEL)
                for name, seconds in medians.items():
                    total = sum(sent[name].values())
                    optimum = _optimum(name, model, seq, nprocs)
                    print(
                        f"| {nprocs} | {seq} | {name} | {seconds:.3f} | {seconds / medians['ulysses']:.2f} "
                        f"| {total:,} | {optimum:,} | {total / optimum:.4f} |",
                        flush=True,
                    )
    print("\nring attention compute per rank alone (forward + backward), max/min over ranks:")
    for nprocs in args.nprocs:
        for seq in args.seqs:
            spread = {
                order: ring_compute_per_rank(seq, nprocs, order) for order in ("contiguous", "head_tail")
            }
            text = ", ".join(
                f"{order}: max {max(s):.3f} s, max/min {max(s) / min(s):.2f}" for order, s in spread.items()
            )
            print(f"  {nprocs} ranks, L={seq}: {text}", flush=True)


def _optimum(name: str, model, seq: int, cp: int) -> int:
    """Rank 0's optimum for one variant (the fingerprint check's few hundred bytes are not in it)."""
    options = VARIANTS[name]
    return optimum_for(
        model, 1, seq, cp, options["implementation"], options.get("sequence_order", "auto")
    ).total


if __name__ == "__main__":
    main()
