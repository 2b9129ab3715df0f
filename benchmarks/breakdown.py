"""Where a training step's time and memory go, per variant of ``cpshard bench``.

    python benchmarks/breakdown.py --seq 4096 --variants single ulysses ulysses-nologits deepspeed

For each variant, one step (after one warm-up step) on every rank of a cp=2 group; rank 0 reports
(1) its self CPU time by kind of op (torch.profiler), and (2) its memory: the largest growth of
the live tensors above the step's start, and the biggest tensors alive at that peak, with the op
that made each. Same model, batch and step functions as the bench.
"""

import argparse
from collections import defaultdict

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from cpshard.bench.config import BenchConfig
from cpshard.bench.measure import _steps
from cpshard.bench.variants import VARIANTS
from cpshard.parallel.mesh import make_mesh
from cpshard.parallel.processes import LocalRanks
from cpshard.runtime.forward import params_of
from cpshard.tools.memory import LiveTensors
from cpshard.tools.tiny import tiny_batch, tiny_model

KINDS = {  # first match wins
    "collectives": (
        "all_to_all",
        "alltoall",
        "all_gather",
        "allgather",
        "all_reduce",
        "allreduce",
        "send",
        "recv",
        "wait",
        "gloo",
        "c10d",
    ),
    "attention": ("scaled_dot_product", "flash_attention", "efficient_attention"),
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "loss": ("log_softmax", "nll_loss", "cross_entropy"),
    "copies": (
        "copy_",
        "aten::cat",
        "aten::stack",
        "aten::clone",
        "contiguous",
        "index_select",
        "_to_copy",
        "index",
        "scatter",
    ),
}


def kind_of(name: str) -> str:
    return next((kind for kind, keys in KINDS.items() if any(key in name for key in keys)), "other")


def breakdown(config: BenchConfig, seq: int, variants: tuple) -> dict:
    mesh = make_mesh(cp=dist.get_world_size())
    model_of = lambda: tiny_model("llama", seed=config.seed, **config.model_sizes())  # noqa: E731
    steps, _ = _steps(model_of, variants, idle_single=False)
    params, batch = params_of(model_of()), tiny_batch(config.vocab, 1, seq, seed=config.seed)
    report = {}
    for name, step in steps.items():
        step(params, batch, mesh)  # warm-up
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(params, batch, mesh)
        kinds = defaultdict(float)
        for event in prof.key_averages():
            kinds[kind_of(event.key)] += event.self_cpu_time_total / 1e6
        dist.barrier()
        with LiveTensors() as live:
            step(params, batch, mesh)
        report[name] = (dict(kinds), live.peak, live.at_peak)
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["single", "ulysses", "ulysses-nologits", "deepspeed"],
        choices=VARIANTS,
    )
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    config = BenchConfig(seqs=(args.seq,), vocab=args.vocab)
    with LocalRanks(2) as ranks:
        report = ranks.run(breakdown, config, args.seq, tuple(args.variants))[0]
    for name, (kinds, peak, at_peak) in report.items():
        total = sum(kinds.values())
        split = ", ".join(
            f"{kind} {seconds:.2f}" for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1])
        )
        print(f"\n{name}: self CPU {total:.2f} s on rank 0: {split}")
        print(f"  peak of tensors made in the step: {peak / 2**20:.0f} MiB; the biggest alive then:")
        for nbytes, what in at_peak:
            print(f"    {nbytes / 2**20:8.1f} MiB  {what}")


if __name__ == "__main__":
    main()
