"""A Nemotron-H-shaped hybrid under cp against one process, and the bytes of its Mamba2 layers across lengths.

    python benchmarks/state_space.py --seqs 256 1024 4096 --nprocs 2 --repeats 3

Mamba2, MLP, Mamba2, attention, Mamba2, MLP layers (Nemotron-H's pattern, small) on local CPU ranks. For each
length: the median training-step time under cp and of one process on the whole batch (rank 0 alone, the
other ranks waiting; alternated in one run, so a noisy machine slows both alike: read the ratio), and the
bytes each rank puts into one Mamba2 layer's collectives per step, measured and analytic, for both schemes:
state passing (the summary's all-gather, its gradient's reduce-scatter: a fixed amount) and the head split
(x, dt, B and C there and the output back, forward and backward: a amount per token); both send the
convolution's halo. Then the crossover of the two.
"""

import argparse
import statistics
import time

import torch

import cpshard
from cpshard.comm.record import recording
from cpshard.tools.tiny import tiny_batch, tiny_model

MODEL = dict(
    layers_block_type=["mamba", "mlp", "mamba", "attention", "mamba", "mlp"],
    num_hidden_layers=6,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=1024,
    mamba_num_heads=8,
    mamba_head_dim=32,
    ssm_state_size=64,
    n_groups=2,
)
ROWS = 1


def _model():
    return tiny_model("nemotron_h", **MODEL)


def _mixer():
    return _model().model.layers[0].mixer


def step_times(seq: int, repeats: int, recurrent: str) -> tuple[dict, int]:
    """On every rank: the median step time under cp (``recurrent``: the scheme) and of one process (rank
    0's), and the bytes of one Mamba2 layer per step under cp."""
    cp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model, alone = _model(), _model()
    batch = tiny_batch(model.config.vocab_size, ROWS, seq)
    mesh, params = cpshard.make_mesh(cp=cp), cpshard.params_of(model)
    step = cpshard.value_and_grad(cpshard.make_cp_forward(model, recurrent=recurrent))
    step(params, batch, mesh)  # the derived layout's probe, untimed
    times, sent = {"cp": [], "one process": []}, 0
    for repeat in range(repeats + 1):
        torch.distributed.barrier()
        with recording() as log:
            start = time.perf_counter()
            step(params, batch, mesh)
            elapsed = time.perf_counter() - start
        sent = sum(e.nbytes for e in log.events if e.name.startswith("model.layers.0.mixer"))
        torch.distributed.barrier()
        if rank == 0:
            start = time.perf_counter()
            alone(**batch).loss.backward()
            solo = time.perf_counter() - start
        torch.distributed.barrier()
        if repeat:  # the first round warms up
            times["cp"].append(elapsed)
            times["one process"].append(solo if rank == 0 else 0.0)
    return {k: statistics.median(v) for k, v in times.items()}, sent


def halo_bytes() -> int:
    """Rank 0's convolution halo per step: its last ``kernel - 1`` inputs sent forward (both schemes)."""
    mixer = _mixer()
    return ROWS * mixer.conv_dim * (mixer.conv_kernel_size - 1) * 4


def summary_exchange_bytes(cp: int) -> int:
    """State passing's bytes per Mamba2 layer, step and rank: the fp32 summary (``[P, N]`` and one decay
    per head) all-gathered forward, cp of them reduce-scattered backward."""
    mixer = _mixer()
    return ROWS * mixer.num_heads * (mixer.head_dim * mixer.ssm_state_size + 1) * 4 * (1 + cp)


def head_split_per_token(cp: int) -> int:
    """The head split's bytes per token of a rank, forward and backward: x and the output (``H x P``) and
    dt (``H``) all-to-all'd; B and C (``G x N`` each) all-to-all'd where cp divides the groups, else
    gathered forward and their gradients reduce-scattered (cp times) backward."""
    mixer = _mixer()
    moved = 2 * (2 * mixer.num_heads * mixer.head_dim + mixer.num_heads)
    pair = 2 * mixer.n_groups * mixer.ssm_state_size
    return ROWS * 4 * (moved + (2 * pair if mixer.n_groups % cp == 0 else pair * (1 + cp)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cp = args.nprocs
    analytic = {
        "state_passing": lambda seq: summary_exchange_bytes(cp) + halo_bytes(),
        "head_split": lambda seq: head_split_per_token(cp) * seq // cp + halo_bytes(),
    }
    print(
        "| L | scheme | cp step s | one process s | cp / one process | bytes/Mamba2 layer/rank | analytic |"
    )
    print("|---|---|---|---|---|---|---|")
    with cpshard.LocalRanks(cp) as ranks:
        for seq in args.seqs:
            for scheme, expected in analytic.items():
                medians, sent = ranks.run(step_times, seq, args.repeats, scheme)[0]
                ratio = medians["cp"] / medians["one process"]
                print(
                    f"| {seq} | {scheme} | {medians['cp']:.3f} | {medians['one process']:.3f} | {ratio:.2f} "
                    f"| {sent:,} | {expected(seq):,} |",
                    flush=True,
                )
    fixed, per_token = summary_exchange_bytes(cp), head_split_per_token(cp)
    print(
        f"\nthe head split moves {per_token:,} B per token of a rank: it crosses state passing's fixed "
        f"{fixed:,} B at {fixed / per_token:.0f} tokens per rank (L = {fixed / per_token * cp:.0f})"
    )


if __name__ == "__main__":
    main()
