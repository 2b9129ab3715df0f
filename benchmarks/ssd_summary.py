"""Mamba2's slice summary under state passing: the closed form against the scan widened by an identity.

    python benchmarks/ssd_summary.py

``cpshard.recurrent.affine.ssd_summary`` runs the model's SSD scan once at its own width and computes the
correction's ``exp(A cumsum(dt)_t) C_t`` and the slice's decay in closed form; the alternative (what a delta
rule must do) widens the scan's ``P`` columns by ``N`` started from the identity. Forward and backward, one
thread, transformers' torch scan, both alternated in one run: read the ratio.
"""

import statistics
import time

import torch
from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

from cpshard.recurrent.affine import ssd_summary

CHUNK = 128
#: (tokens, heads, P, N, groups): Nemotron-H's head shape at two slice lengths, and a smaller head
SHAPES = [(1024, 8, 64, 128, 2), (4096, 8, 64, 128, 2), (1024, 8, 32, 64, 2)]


def widened(x, dt, A, B, C, **kwargs):
    """The scan on ``P + N`` columns, the new ones zero and started from the identity."""
    batch, tokens, heads, width = x.shape
    size = B.shape[-1]
    identity = torch.eye(size).expand(batch, heads, size, size)
    initial = torch.cat([identity.new_zeros(batch, heads, width, size), identity], dim=-2)
    wide = torch.cat([x, x.new_zeros(batch, tokens, heads, size)], dim=-1)
    return mamba2_chunk_scan(
        wide, dt, A, B, C, CHUNK, initial_states=initial, return_final_states=True, **kwargs
    )


def closed_form(x, dt, A, B, C, **kwargs):
    return ssd_summary(mamba2_chunk_scan, x, dt, A, B, C, CHUNK, **kwargs)


def step(summarise, inputs: dict, kwargs: dict) -> float:
    start = time.perf_counter()
    sum(t.sum() for t in summarise(**inputs, **kwargs)).backward()
    return time.perf_counter() - start


def main():
    torch.set_num_threads(1)
    print("| tokens | heads | P | N | widened ms | closed form ms | closed form / widened |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for tokens, heads, width, size, groups in SHAPES:
        gen = torch.Generator().manual_seed(0)
        shapes = {"x": (tokens, heads, width), "dt": (tokens, heads), "B": (tokens, groups, size)}
        shapes["C"] = shapes["B"]
        inputs = {k: torch.randn(1, *s, generator=gen).requires_grad_() for k, s in shapes.items()}
        inputs["A"] = -torch.rand(heads, generator=gen) - 0.5
        kwargs = {"D": torch.randn(heads, generator=gen), "dt_bias": torch.randn(heads), "dt_softplus": True}
        times = {"widened": [], "closed": []}
        for _ in range(5):
            times["widened"].append(step(widened, inputs, kwargs))
            times["closed"].append(step(closed_form, inputs, kwargs))
        wide, closed = (statistics.median(times[k][1:]) for k in ("widened", "closed"))
        print(
            f"| {tokens} | {heads} | {width} | {size} | {wide * 1e3:.0f} | {closed * 1e3:.0f} "
            f"| {closed / wide:.2f} |"
        )


if __name__ == "__main__":
    main()
