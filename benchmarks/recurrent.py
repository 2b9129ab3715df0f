"""A Gated DeltaNet hybrid under cp: state passing against the head split and one process, across lengths.

    python benchmarks/recurrent.py --seqs 64 256 1024 4096 --nprocs 2 --repeats 3

A Qwen3.5-shaped model (three Gated DeltaNet layers to one attention layer, dense MLPs) on local CPU ranks.
For each length: the median training-step time of both schemes and of one process on the whole batch (rank
0 alone, the other ranks waiting; alternated in one run, so a noisy machine slows them alike: read the
ratios; the load average is printed beside them), the bytes each rank puts into the linear layers'
collectives per layer and step (halo included), measured and analytic; then the measured crossover (the
first length where the head split moves more) beside the analytic one (``state_passing_bytes`` over the
head split's bytes per token of a rank).
"""

import argparse
import os
import statistics
import time

import torch

import cpshard
from cpshard.comm.record import recording
from cpshard.recurrent.slots import state_passing_bytes
from cpshard.tools.tiny import tiny_batch, tiny_model

MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=1024,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_hidden_layers=4,
)
SCHEMES = ("state_passing", "head_split")
ROWS = 1


def _model():
    return tiny_model("qwen3_5_text", **MODEL)


def _one_process(model, batch) -> float:
    """Rank 0's step of the plain model on the whole batch, the other ranks waiting (0 on them)."""
    torch.distributed.barrier()
    start = time.perf_counter()
    if torch.distributed.get_rank() == 0:
        model(**batch).loss.backward()
    elapsed = time.perf_counter() - start
    torch.distributed.barrier()
    return elapsed


def step_times(seq: int, repeats: int):
    """On every rank: median step time of each scheme and of one process, and bytes per linear layer and
    step."""
    cp = torch.distributed.get_world_size()
    model, alone = _model(), _model()
    batch = tiny_batch(model.config.vocab_size, ROWS, seq)
    mesh, params = cpshard.make_mesh(cp=cp), cpshard.params_of(model)
    steps = {s: cpshard.value_and_grad(cpshard.make_cp_forward(model, recurrent=s)) for s in SCHEMES}
    linear = model.config.layer_types.count("linear_attention")
    times, sent = {s: [] for s in (*SCHEMES, "one process")}, {}
    for repeat in range(repeats + 1):
        solo = _one_process(alone, batch)
        if repeat:
            times["one process"].append(solo)
        for scheme, step in steps.items():
            torch.distributed.barrier()
            with recording() as log:
                start = time.perf_counter()
                step(params, batch, mesh)
                elapsed = time.perf_counter() - start
            if repeat:  # the first round warms up
                times[scheme].append(elapsed)
            sent[scheme] = sum(e.nbytes for e in log.events if "linear_attn" in e.name) // linear
    return {s: statistics.median(values) for s, values in times.items()}, sent


def analytic(seq: int, cp: int) -> dict[str, int]:
    """Rank 0's bytes per linear layer and step of each scheme, from the mixer's sizes."""
    mixer = _model().model.layers[0].linear_attn
    heads, dk, dv = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    halo = ROWS * mixer.conv_dim * (mixer.conv_kernel_size - 1) * 4  # rank 0 sends forward only
    return {
        "state_passing": state_passing_bytes(ROWS, heads, dk, dv, cp) + halo,
        "head_split": _head_split_per_token(mixer) * (-(-seq // cp)) + halo,
    }


def _head_split_per_token(mixer) -> int:
    """Bytes of one rank's token through the head split, forward and backward: q, k; v and the output;
    the decay and beta (fp32)."""
    per_token = mixer.num_k_heads * mixer.head_k_dim * 2 + mixer.num_v_heads * (mixer.head_v_dim * 2 + 2)
    return 2 * ROWS * per_token * 4


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cp = args.nprocs
    print(
        "| L | scheme | step s | vs state passing | vs one process | bytes/linear layer/rank | analytic "
        "| load |"
    )
    print("|---|---|---|---|---|---|---|---|")
    measured_cross = None
    with cpshard.LocalRanks(cp) as ranks:
        for seq in args.seqs:
            medians, sent = ranks.run(step_times, seq, args.repeats)[0]
            expected = analytic(seq, cp)
            for scheme in SCHEMES:
                ratio, alone = (medians[scheme] / medians[k] for k in ("state_passing", "one process"))
                print(
                    f"| {seq} | {scheme} | {medians[scheme]:.3f} | {ratio:.2f} | {alone:.2f} "
                    f"| {sent[scheme]:,} | {expected[scheme]:,} | {os.getloadavg()[0]:.1f} |",
                    flush=True,
                )
            if measured_cross is None and sent["head_split"] > sent["state_passing"]:
                measured_cross = seq
    mixer = _model().model.layers[0].linear_attn
    summary = state_passing_bytes(ROWS, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, cp)
    crossing = summary / _head_split_per_token(mixer)
    print(
        f"\ncrossover: analytic {crossing:.1f} tokens per rank (L = {crossing * cp:.0f}); measured: the head "
        f"split moves more from L = {measured_cross} on, of the lengths run"
    )


if __name__ == "__main__":
    main()
