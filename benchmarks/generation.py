"""Generation under cp against one process: prefill time and per-token decode time as ratios in one run,
and the longest prompt that fits a per-rank memory budget.

    python benchmarks/generation.py --seqs 8192 32768 --nprocs 2 4 --new 8 --threads 4 --budget-gib 1

One process runs transformers' own forward with its own cache (the prompt, then one token at a time, as
``model.generate`` does); cp runs ``make_cp_prefill`` / ``make_cp_decode`` on ``nprocs`` local CPU ranks.
Each rank and the one process get ``--threads`` threads, as if each had a device of its own. Memory: the
KV cache's bytes on the fullest rank, and the peak resident memory of the largest process; the longest
prompt within ``--budget-gib`` per rank is extrapolated from those (both grow linearly in the prompt).
"""

import argparse
import resource
import time

import torch
import torch.distributed as dist

import cpshard
from cpshard.tools.tiny import tiny_model
from cpshard.tools.usage import llama_sizes

MODEL = llama_sizes(vocab=1024, hidden=128, layers=2, heads=8, kv_heads=4)
WARM_UP = 256
MIB = 1 << 20


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(3, MODEL["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _timed(fn, sync=lambda: None):
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def one_process(lengths: list[int], new: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    model = tiny_model("llama", **MODEL)
    rows = []
    with torch.no_grad():
        for length in [WARM_UP, *lengths]:
            ids = _prompt(length)
            prefill, out = _timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))  # noqa: B023
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(new):
                out = model(input_ids=token, cache=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            decode = (time.perf_counter() - start) / new
            cache_bytes = sum(
                t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
            )
            rows.append(
                dict(length=length, prefill=prefill, decode=decode, cache=cache_bytes, rss=_peak_rss())
            )
            del cache, out
    return rows[1:]


def cp_ranks(lengths: list[int], new: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    model = tiny_model("llama", **MODEL)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    cp_prefill, cp_decode = cpshard.make_cp_prefill(model), cpshard.make_cp_decode(model)
    params, rows = cpshard.params_of(model), []
    for length in [WARM_UP, *lengths]:
        batch = {"input_ids": _prompt(length)}
        prefill, (logits, cache) = _timed(lambda: cp_prefill(params, batch, mesh), dist.barrier)  # noqa: B023
        dist.barrier()
        start = time.perf_counter()
        for _ in range(new):
            logits, cache = cp_decode(params, logits.argmax(-1), cache, mesh)
        dist.barrier()
        decode = (time.perf_counter() - start) / new
        rows.append(dict(length=length, prefill=prefill, decode=decode, cache=cache.nbytes, rss=_peak_rss()))
        del cache
    return rows[1:]


def longest(rows: list[dict], key: str, budget: int) -> int:
    """The prompt length at which ``key`` (linear in the length, fitted through the two longest) reaches
    ``budget``."""
    (a, b) = rows[-2:] if len(rows) > 1 else ({"length": 0, key: 0}, rows[-1])
    slope = (b[key] - a[key]) / (b["length"] - a["length"])
    return int(b["length"] + (budget - b[key]) / slope)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--new", type=int, default=8, help="decoded tokens timed per prompt")
    parser.add_argument("--threads", type=int, default=1, help="threads of each rank and of the one process")
    parser.add_argument(
        "--budget-gib", type=float, default=1.0, help="memory per rank for the longest prompt"
    )
    args = parser.parse_args()
    budget = int(args.budget_gib * (1 << 30))
    results = {1: one_process(args.seqs, args.new, args.threads)}
    for nprocs in args.nprocs:
        every = cpshard.launch(cp_ranks, args.seqs, args.new, args.threads, nprocs=nprocs)
        results[nprocs] = [
            {**rows[0], "cache": max(r["cache"] for r in per), "rss": max(r["rss"] for r in per)}
            for rows, per in ((every[0], [ranks[i] for ranks in every]) for i in range(len(args.seqs)))
        ]
    print(f"llama {MODEL}, batch 1, {args.threads} threads per rank, {args.new} decoded tokens timed")
    print("| ranks | L | prefill s | vs 1 | decode ms/token | vs 1 | KV cache MiB/rank | peak RSS MiB/rank |")
    print("|---|---|---|---|---|---|---|---|")
    base = {row["length"]: row for row in results[1]}
    for nprocs, rows in results.items():
        for row in rows:
            one = base[row["length"]]
            prefill, decode = row["prefill"] / one["prefill"], row["decode"] / one["decode"]
            print(
                f"| {nprocs} | {row['length']} | {row['prefill']:.3f} | {prefill:.2f} | "
                f"{row['decode'] * 1e3:.2f} | {decode:.2f} | {row['cache'] / MIB:.2f} | "
                f"{row['rss'] / MIB:.0f} |"
            )
    print(f"\nlongest prompt within {args.budget_gib} GiB per rank (extrapolated from the two longest):")
    for nprocs, rows in results.items():
        print(
            f"  {nprocs} rank(s): KV cache alone {longest(rows, 'cache', budget):,} tokens; "
            f"peak resident memory {longest(rows, 'rss', budget):,} tokens"
        )


if __name__ == "__main__":
    main()
