"""Generation under cp against one process: prefill time and per-token decode time as ratios in one run,
and the longest prompt that fits a per-rank memory budget.

    python benchmarks/generation.py --seqs 8192 32768 --nprocs 2 4 --new 8 --threads 1 --budget-gib 1

One process runs transformers' own forward with its own cache (the prompt, then one token at a time, as
``model.generate`` does); cp runs ``make_cp_prefill`` / ``make_cp_decode`` on ``nprocs`` local CPU ranks.
Each rank and the one process get ``--threads`` threads, as if each had a device of its own. Times: wall
(rank 0's, between barriers: the group's) and CPU (the busiest rank's: on a shared machine the steadier
measure of the work, since the wall time also counts waiting for the scheduler). Memory: the KV cache's
bytes on the fullest rank and the largest peak resident memory (VmHWM); the longest prompt within
``--budget-gib`` per rank is extrapolated from those (both grow linearly in the prompt).
"""

import argparse
import time

import torch
import torch.distributed as dist

import cpshard
from cpshard.tools.tiny import tiny_model
from cpshard.tools.usage import llama_sizes

MODEL = llama_sizes(vocab=1024, hidden=128, layers=2, heads=8, kv_heads=4)
WARM_UP = 256
MIB = 1 << 20
#: (key, unit, scale, digits) of the timed columns
TIMES = (("prefill", "s", 1, 3), ("prefill_cpu", "CPU s", 1, 3), ("decode", "ms/token", 1e3, 2))
TIMES += (("decode_cpu", "CPU ms/token", 1e3, 2),)
#: taken from the busiest (fullest) rank
BUSIEST = ("prefill_cpu", "decode_cpu", "cache", "rss")


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(3, MODEL["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))


def _peak_rss() -> int:
    """This process's peak resident bytes: Linux's VmHWM (ru_maxrss would count the parent's peak too: a
    spawned rank inherits it across fork and exec)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _timed(sync, fn, *args, **kwargs) -> tuple[float, float, object]:
    """``(wall seconds, this process's CPU seconds, fn(*args, **kwargs))``."""
    sync()
    start, cpu = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    sync()
    return time.perf_counter() - start, time.process_time() - cpu, result


def _no_sync() -> None:
    pass


def _row(length: int, prefill: tuple, decode: tuple, new: int, cache_bytes: int) -> dict:
    times = dict(
        prefill=prefill[0], prefill_cpu=prefill[1], decode=decode[0] / new, decode_cpu=decode[1] / new
    )
    return dict(length=length, **times, cache=cache_bytes, rss=_peak_rss())


def _one_process_steps(model, out, new: int):
    cache = out.past_key_values
    for _ in range(new):
        out = model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), cache=cache, use_cache=True)
        cache = out.past_key_values
    return cache


def one_process(lengths: list[int], new: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    model = tiny_model("llama", **MODEL)
    rows = []
    with torch.no_grad():
        for length in [WARM_UP, *lengths]:
            wall, cpu, out = _timed(
                _no_sync, model, input_ids=_prompt(length), use_cache=True, logits_to_keep=1
            )
            prefill = (wall, cpu)
            wall, cpu, cache = _timed(_no_sync, _one_process_steps, model, out, new)
            decode = (wall, cpu)
            held = sum(
                t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
            )
            rows.append(_row(length, prefill, decode, new, held))
            del cache, out
    return rows[1:]


def _cp_steps(cp_decode, params, logits, cache, mesh, new: int):
    for _ in range(new):
        logits, cache = cp_decode(params, logits.argmax(-1), cache, mesh)
    return cache


def cp_ranks(lengths: list[int], new: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    model = tiny_model("llama", **MODEL)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    cp_prefill, cp_decode = cpshard.make_cp_prefill(model), cpshard.make_cp_decode(model)
    params, rows = cpshard.params_of(model), []
    for length in [WARM_UP, *lengths]:
        batch = {"input_ids": _prompt(length)}
        wall, cpu, (logits, cache) = _timed(dist.barrier, cp_prefill, params, batch, mesh)
        prefill = (wall, cpu)
        wall, cpu, cache = _timed(dist.barrier, _cp_steps, cp_decode, params, logits, cache, mesh, new)
        decode = (wall, cpu)
        rows.append(_row(length, prefill, decode, new, cache.nbytes))
        del cache
    return rows[1:]


def longest(rows: list[dict], key: str, budget: int) -> str:
    """The prompt length at which ``key`` (linear in the length, fitted through the two longest prompts)
    reaches ``budget``."""
    (a, b) = rows[-2:] if len(rows) > 1 else ({"length": 0, key: 0}, rows[-1])
    slope = (b[key] - a[key]) / (b["length"] - a["length"])
    return f"{int(b['length'] + (budget - b[key]) / slope):,}" if slope > 0 else "n/a (it did not grow)"


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
            {**every[0][i], **{key: max(ranks[i][key] for ranks in every) for key in BUSIEST}}
            for i in range(len(args.seqs))
        ]
    print(f"llama {MODEL}, batch 1, {args.threads} threads per rank, {args.new} decoded tokens timed")
    columns = " | ".join(f"{unit} | vs 1" for _, unit, _, _ in TIMES)
    print(f"| ranks | L | {columns} | KV cache MiB/rank | peak MiB/rank |")
    print("|---" * (4 + 2 * len(TIMES)) + "|")
    base = {row["length"]: row for row in results[1]}
    for nprocs, rows in results.items():
        for row in rows:
            one = base[row["length"]]
            times = " | ".join(
                f"{row[key] * scale:.{digits}f} | {row[key] / one[key]:.2f}"
                for key, _, scale, digits in TIMES
            )
            memory = f"{row['cache'] / MIB:.2f} | {row['rss'] / MIB:.0f}"
            print(f"| {nprocs} | {row['length']} | {times} | {memory} |")
    print(f"\nlongest prompt within {args.budget_gib} GiB per rank (extrapolated from the two longest):")
    for nprocs, rows in results.items():
        print(
            f"  {nprocs} rank(s): KV cache alone {longest(rows, 'cache', budget)} tokens; "
            f"peak resident memory {longest(rows, 'rss', budget)} tokens"
        )


if __name__ == "__main__":
    main()
