"""Compiled against eager cp training steps: compile time apart from step time, as ratios in one run.

    python benchmarks/compile.py --seqs 1024 4096 --steps 4 --backend inductor

On ``--nprocs`` local CPU ranks (one thread each), one model is run twice per length with the same
weights and batch: ``make_cp_forward(model)`` and ``make_cp_forward(model, compile=backend)``, each
under ``cpshard.value_and_grad``. The first compiled call of a length (tracing and code generation) is
reported apart, then ``--steps`` steps of each, alternated, give the median step time (wall, between
barriers: the group's; and the busiest rank's CPU time). The compiled loss is checked against eager's.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import cpshard
from cpshard.tools.tiny import tiny_batch, tiny_model
from cpshard.tools.usage import llama_sizes

MODEL = llama_sizes(vocab=1024, hidden=256, layers=2, heads=8, kv_heads=4, intermediate=688)


def _step(step, params, batch, mesh) -> tuple[float, float, float]:
    """``(wall s, CPU s, loss)`` of one step, between barriers."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    out, _ = step(params, batch, mesh)
    dist.barrier()
    return time.perf_counter() - start, time.process_time() - cpu, out.loss.item()


def measure(seqs: list[int], steps: int, backend: str) -> list[dict]:
    """On each rank: per length, the compile call and the median eager and compiled steps."""
    torch.set_num_threads(1)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    model = tiny_model("llama", **MODEL)
    params = cpshard.params_of(model)
    eager = cpshard.value_and_grad(cpshard.make_cp_forward(model))
    compiled = cpshard.value_and_grad(cpshard.make_cp_forward(model, compile=backend))
    rows = []
    for seq in seqs:
        batch = tiny_batch(MODEL["vocab_size"], 1, seq)
        _step(eager, params, batch, mesh)  # warm-up: allocator, first collectives
        first = _step(compiled, params, batch, mesh)
        timed = {"eager": [], "compiled": []}
        for _ in range(steps):
            for name, step in (("eager", eager), ("compiled", compiled)):
                timed[name].append(_step(step, params, batch, mesh))
        row = {"seq": seq, "compile_s": first[0]}
        for name, runs in timed.items():
            row[name] = statistics.median(r[0] for r in runs)
            row[f"{name}_cpu"] = statistics.median(r[1] for r in runs)
        row["loss_diff"] = abs(timed["eager"][-1][2] - timed["compiled"][-1][2])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    per_rank = cpshard.launch(measure, args.seqs, args.steps, args.backend, nprocs=args.nprocs, timeout=3000)
    print(f"cp={args.nprocs}, backend {args.backend}, Llama hidden 256, 2 layers, vocab 1024, B=1")
    print(
        "| L | first compiled call s | eager step s | compiled step s | compiled / eager (wall) |"
        " compiled / eager (busiest rank's CPU) | loss diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for index, row in enumerate(per_rank[0]):
        cpu = {k: max(r[index][k] for r in per_rank) for k in ("eager_cpu", "compiled_cpu")}
        print(
            f"| {row['seq']} | {row['compile_s']:.1f} | {row['eager']:.3f} | {row['compiled']:.3f} "
            f"| {row['compiled'] / row['eager']:.2f} | {cpu['compiled_cpu'] / cpu['eager_cpu']:.2f} "
            f"| {row['loss_diff']:.1e} |"
        )


if __name__ == "__main__":
    main()
