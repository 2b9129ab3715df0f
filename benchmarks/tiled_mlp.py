"""What the tiled MLP (``make_cp_forward(mlp_tile=N)``) does to a rank's peak memory and step time under cp.

    python benchmarks/tiled_mlp.py --seqs 8192 16384 --tile 1024 --repeats 2

The bench's model (``cpshard bench``: a 2-layer llama, hidden 256, 8 heads, 4 kv heads, intermediate
1,024, vocabulary 32,000), Ulysses over 2 local ranks, batch 1, ``logits=False``, without and with
transformers' activation checkpointing of the layers; each variant's training step with and without
the tiled MLP, alternated in each round. Memory is the peak of the tensors a step allocates on the
busiest rank (:class:`cpshard.tools.memory.LiveTensors`: exact, where the resident size also holds what
glibc's heap kept of earlier steps); time is CPU seconds of that rank's step (median over rounds).
"""

import argparse
import gc
import statistics
import time

import torch.distributed as dist

import cpshard
from cpshard.tools.memory import LiveTensors
from cpshard.tools.tiny import tiny_batch, tiny_model
from cpshard.tools.usage import llama_sizes

SIZES = llama_sizes(vocab=32000, hidden=256, layers=2, heads=8, kv_heads=4)
MIB = 2**20


def _variant(checkpointing: bool, tile: int | None):
    model = tiny_model("llama", **SIZES).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    tiling = {} if tile is None else dict(mlp_tile=tile)
    return cpshard.value_and_grad(cpshard.make_cp_forward(model, logits=False, **tiling))


def _measured(step, params, batch, mesh) -> tuple[float, float]:
    """One step: the peak of the tensors it allocates (bytes, an untimed step) and its CPU seconds."""
    gc.collect()
    dist.barrier()
    with LiveTensors() as live:
        step(params, batch, mesh)
    dist.barrier()
    cpu = time.process_time()
    step(params, batch, mesh)
    return live.peak, time.process_time() - cpu


def rank_job(seq: int, tile: int, repeats: int) -> dict:
    """On every rank: each variant's peak memory growth and CPU time per round."""
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    params = cpshard.params_of(tiny_model("llama", **SIZES))
    batch = tiny_batch(SIZES["vocab_size"], 1, seq)
    steps = {
        (checkpointing, tiled): _variant(checkpointing, tile if tiled else None)
        for checkpointing in (False, True)
        for tiled in (False, True)
    }
    for step in steps.values():  # warm-up (and each layout's one probe)
        step(params, batch, mesh)
    results = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            results[key].append(_measured(step, params, batch, mesh))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(
        f"| L | layers checkpointed | peak MiB/rank | mlp_tile={args.tile} | ratio | CPU s | tiled | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with cpshard.LocalRanks(2, timeout=3000) as ranks:
        for seq in args.seqs:
            per_rank = ranks.run(rank_job, seq, args.tile, args.repeats)
            for checkpointing in (False, True):
                memory, seconds = [], []
                for tiled in (False, True):
                    rounds = [r[(checkpointing, tiled)] for r in per_rank]  # per rank, per round
                    memory.append(max(statistics.median(g for g, _ in r) for r in rounds) / MIB)
                    seconds.append(max(statistics.median(c for _, c in r) for r in rounds))
                print(
                    f"| {seq} | {'yes' if checkpointing else 'no'} | {memory[0]:,.0f} | {memory[1]:,.0f} "
                    f"| {memory[1] / memory[0]:.2f} | {seconds[0]:.2f} | {seconds[1]:.2f} "
                    f"| {seconds[1] / seconds[0]:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
