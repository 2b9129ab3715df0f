"""A state-space hybrid under cp against one process, and the bytes of its state-space layers across lengths.

    python benchmarks/state_space.py --seqs 256 1024 4096 --nprocs 2 --repeats 3
    python benchmarks/state_space.py --family mamba1 --seqs 256 1024 4096

``--family mamba2`` (the default): Mamba2, MLP, Mamba2, attention, Mamba2, MLP layers (Nemotron-H's
pattern, small); ``--family mamba1``: Mamba1, Mamba1, attention, Mamba1 layers with MLPs (Jamba's, small).
On local CPU ranks, for each length: the median training-step time under cp and of one process on the whole
batch (rank 0 alone, the other ranks waiting; alternated in one run, so a noisy machine slows both alike:
read the ratio), and the bytes each rank puts into its first state-space layer's collectives per step,
measured and analytic, for each scheme. Mamba2: state passing (the summary's all-gather, its gradient's
reduce-scatter: a fixed amount) and the head split (x, dt, B and C there and the output back, forward and
backward: an amount per token), then the crossover of the two. Mamba1: the split over channels (x, dt, z
and the output there and back, B and C gathered: an amount per token). Every scheme sends the
convolution's halo.
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
#: Jamba's pattern, small: Mamba1 layers (``d_inner`` 256, ``N`` 16) and one attention layer, dense MLPs
MAMBA1_MODEL = dict(
    num_hidden_layers=4,
    attn_layer_period=4,
    attn_layer_offset=2,
    num_experts=1,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    mamba_d_state=16,
    mamba_expand=2,
)
#: per family: the model type, its sizes, and the path of its first state-space mixer
FAMILIES = {
    "mamba2": ("nemotron_h", MODEL, "model.layers.0.mixer"),
    "mamba1": ("jamba", MAMBA1_MODEL, "model.layers.0.mamba"),
}
ROWS = 1


def _model(family: str = "mamba2"):
    model_type, sizes, _ = FAMILIES[family]
    return tiny_model(model_type, **sizes)


def _mixer(family: str = "mamba2"):
    return _model(family).get_submodule(FAMILIES[family][2])


def step_times(seq: int, repeats: int, recurrent: str, family: str) -> tuple[dict, int]:
    """On every rank: the median step time under cp (``recurrent``: the scheme) and of one process (rank
    0's), and the bytes of the family's first state-space layer per step under cp."""
    cp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model, alone = _model(family), _model(family)
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
        sent = sum(e.nbytes for e in log.events if e.name.startswith(FAMILIES[family][2]))
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


def halo_bytes(family: str = "mamba2") -> int:
    """Rank 0's convolution halo per step: its last ``kernel - 1`` inputs sent forward (every scheme)."""
    mixer = _mixer(family)
    channels = mixer.conv_dim if family == "mamba2" else mixer.intermediate_size
    return ROWS * channels * (mixer.conv_kernel_size - 1) * 4


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


def channel_split_per_token(cp: int) -> int:
    """Mamba1's split over channels, bytes per token of a rank, forward and backward: x, dt, z and the
    output (``D`` each) all-to-all'd both ways; B and C (``N`` each) gathered forward and their gradients
    reduce-scattered (cp times) backward."""
    mixer = _mixer("mamba1")
    return ROWS * 4 * (2 * 4 * mixer.intermediate_size + 2 * mixer.ssm_state_size * (1 + cp))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--family", choices=list(FAMILIES), default="mamba2")
    args = parser.parse_args()
    cp, family = args.nprocs, args.family
    if family == "mamba2":
        analytic = {
            "state_passing": lambda seq: summary_exchange_bytes(cp) + halo_bytes(),
            "head_split": lambda seq: head_split_per_token(cp) * seq // cp + halo_bytes(),
        }
    else:  # Mamba1's one scheme ("auto": the split over channels)
        analytic = {"auto": lambda seq: channel_split_per_token(cp) * seq // cp + halo_bytes(family)}
    columns = ("L", "scheme", "cp step s", "one process s", "cp / one process", f"bytes/{family} layer/rank")
    print(f"| {' | '.join(columns)} | analytic |")
    print("|---|---|---|---|---|---|---|")
    with cpshard.LocalRanks(cp) as ranks:
        for seq in args.seqs:
            for scheme, expected in analytic.items():
                medians, sent = ranks.run(step_times, seq, args.repeats, scheme, family)[0]
                ratio = medians["cp"] / medians["one process"]
                print(
                    f"| {seq} | {scheme} | {medians['cp']:.3f} | {medians['one process']:.3f} | {ratio:.2f} "
                    f"| {sent:,} | {expected(seq):,} |",
                    flush=True,
                )
    if family == "mamba2":
        fixed, per_token = summary_exchange_bytes(cp), head_split_per_token(cp)
        print(
            f"\nthe head split moves {per_token:,} B per token of a rank: it crosses state passing's fixed "
            f"{fixed:,} B at {fixed / per_token:.0f} tokens per rank (L = {fixed / per_token * cp:.0f})"
        )


if __name__ == "__main__":
    main()
