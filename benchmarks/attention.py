"""Ulysses, ring and hybrid side by side, and what head-tail order does for ring's balance.

    python benchmarks/attention.py --seqs 1024 2048 4096 --nprocs 2 4 --repeats 3
    python benchmarks/attention.py --packed 20 --seqs 16384 --nprocs 4 --repeats 3

For each rank count and length: the median training-step time of every implementation that
fits (alternated in one run, so a noisy machine slows all alike; read the ratios), the bytes
each rank sends per step against the analytic optimum, and, for ring, the attention compute of
each rank alone (max/min over ranks) with contiguous and with head-tail order. ``--packed ROWS``: on rows
packing documents instead, each order's tiles per rank counted (:func:`cpshard.spec.balance.ring_work`)
and each rank's attention compute timed.
"""

import argparse
import statistics
import time

import torch

import cpshard
from cpshard.attention.blocks import ring_blocks
from cpshard.attention.ring import grouped, tiled_attention, tiled_grads
from cpshard.comm.record import recording
from cpshard.debug.optimum import optimum_for
from cpshard.spec.balance import lognormal_documents, packed_mask, ring_work
from cpshard.spec.sequence import chunk_width, padded_length_for, positions
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


def _ring_compute(blocks, q, k, v, rank: int, cp: int) -> None:
    """One rank's ring attention arithmetic, forward and backward, over every block it needs."""
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for source in range(cp):
        if blocks.needed[rank][source]:
            tiled_attention(out, lse, q, k, v, blocks.masks[source], 0.25, None, None, blocks.tiles[source])
    grad_q, grad_kv, delta = torch.zeros_like(q), torch.zeros(2, *k.shape), (out * out).sum(-1)
    for source in range(cp):
        if blocks.needed[rank][source]:
            tiled_grads(
                grad_q,
                grad_kv,
                q,
                k,
                v,
                blocks.masks[source],
                lse,
                out,
                out,
                delta,
                0.25,
                None,
                None,
                blocks.tiles[source],
            )


def ring_compute_per_rank(seq: int, cp: int, order: str, repeats: int = 3, documents=None) -> list[float]:
    """Each rank's ring attention compute (forward and backward, all its blocks), timed alone, the ranks
    alternated in each round (a slow spell slows them alike); causal, or ``documents`` packed in the row
    (their lengths). CPU seconds of this process."""
    heads, kv_heads, dim = MODEL["num_attention_heads"], MODEL["num_key_value_heads"], MODEL["head_dim"]
    length = padded_length_for(seq, cp, order)
    held = [positions(order, length, cp, r) for r in range(cp)]
    mask = None if documents is None else packed_mask(documents, length)
    tile = chunk_width(order, length, cp)
    plans = [ring_blocks(mask, held, seq, rank, uniform_rows=False, tile=tile) for rank in range(cp)]
    q = grouped(torch.randn(1, heads, length // cp, dim), kv_heads)
    k, v = torch.randn(2, 1, kv_heads, length // cp, dim)
    runs = [[] for _ in range(cp)]
    for _ in range(repeats):
        for rank in range(cp):
            start = time.process_time()
            _ring_compute(plans[rank], q, k, v, rank, cp)
            runs[rank].append(time.process_time() - start)
    return [statistics.median(r) for r in runs]


#: issue 18's packed rows: documents log-normal around 1K tokens (sigma 1.2)
DOCUMENTS = dict(median=1024, sigma=1.2)
ORDERS = ("contiguous", "head_tail", "striped")


def packed_report(seqs: list[int], nprocs: list[int], repeats: int, rows: int) -> None:
    """Ring work on packed rows: counted (cp=8, 131,072 tokens, 128 x 128 tiles, ``rows`` rows) and timed
    (each rank's attention compute at every length and rank count)."""
    print(
        f"tiles per rank on packed 131,072-token rows, cp=8, 128 x 128 tiles (mean and worst of {rows} rows):"
    )
    print("| order | busiest / mean, mean | worst | tiles / one process, mean | worst |")
    print("|---|---|---|---|---|")
    documents = [lognormal_documents(131_072, seed=seed, **DOCUMENTS) for seed in range(rows)]
    for order in ORDERS:
        work = [ring_work(order, row, 8) for row in documents]
        busiest, extra = [w.busiest for w in work], [w.extra_tiles for w in work]
        print(
            f"| {order} | {statistics.mean(busiest):.3f} | {max(busiest):.3f} "
            f"| {statistics.mean(extra):.3f} | {max(extra):.3f} |",
            flush=True,
        )
    torch.set_num_threads(1)  # CPU time of one thread: what a rank's share of the arithmetic costs
    print("\nring attention compute per rank alone on one packed row (forward + backward, CPU s):")
    print("| ranks | L | order | busiest rank s | busiest / mean | busiest / least | all ranks s |")
    print("|---|---|---|---|---|---|---|")
    for cp in nprocs:
        for seq in seqs:
            row = lognormal_documents(seq, seed=0, **DOCUMENTS)
            for order in ORDERS:
                times = ring_compute_per_rank(seq, cp, order, repeats, documents=row)
                print(
                    f"| {cp} | {seq} | {order} | {max(times):.3f} | {max(times) * cp / sum(times):.2f} "
                    f"| {max(times) / min(times):.2f} | {sum(times):.3f} |",
                    flush=True,
                )


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
