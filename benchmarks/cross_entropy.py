"""cpshard's cross-entropy against torch's, forward and backward, on one thread.

    python benchmarks/cross_entropy.py

``cpshard.loss.cross_entropy.cross_entropy_sum`` (what ``cp_forward``'s loss runs on the logits) against
``F.cross_entropy(..., reduction="sum")`` (what the peers' steps run), the two alternated in one run: read
the ratio. fp32 logits of a rank's rows at a small and a large vocabulary.
"""

import statistics
import time

import torch
import torch.nn.functional as F

from cpshard.loss.cross_entropy import cross_entropy_sum

#: (rows, vocabulary): a rank's tokens at L = 2048 and 8192 over cp = 2, and at a 32k vocabulary
SHAPES = [(1024, 1024), (4096, 1024), (1024, 32000)]


def _torch(logits, labels):
    return F.cross_entropy(logits, labels, reduction="sum")


def step(loss_fn, logits: torch.Tensor, labels: torch.Tensor) -> float:
    leaf = logits.detach().requires_grad_()
    start = time.perf_counter()
    (loss_fn(leaf, labels) / labels.numel()).backward()
    return time.perf_counter() - start


def main():
    torch.set_num_threads(1)
    print("| rows | vocabulary | torch ms | cpshard ms | cpshard / torch |")
    print("|---:|---:|---:|---:|---:|")
    for rows, vocab in SHAPES:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(rows, vocab, generator=gen)
        labels = torch.randint(0, vocab, (rows,), generator=gen)
        times = {"torch": [], "cpshard": []}
        for _ in range(7):
            times["torch"].append(step(_torch, logits, labels))
            times["cpshard"].append(step(cross_entropy_sum, logits, labels))
        ours, theirs = (statistics.median(times[k][1:]) for k in ("cpshard", "torch"))
        print(f"| {rows} | {vocab} | {theirs * 1e3:.1f} | {ours * 1e3:.1f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
