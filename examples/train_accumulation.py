"""A torch training loop under cp: ``backward()`` and a torch optimizer, with gradient accumulation.

    torchrun --nproc_per_node 2 examples/train_accumulation.py
    python examples/train_accumulation.py --nprocs 2

``out.loss.backward()`` leaves in each ``param.grad`` the gradient one process would compute on
the whole batch (cpshard sums it over the cp ranks in the backward), so any torch optimizer works.
For gradient accumulation each micro-batch carries ``num_items_in_batch``, the label tokens of the
whole optimizer step (``cpshard.count_label_tokens``): each loss is then its token-loss sum over that
count, and the gradients summed over the micro-batches are exactly those of the step's whole batch,
however many tokens each micro-batch holds.
"""

import argparse
import os

import torch

import cpshard
from cpshard import tiny_model


def micro_batches(vocab: int, seq: int, count: int, step: int) -> list[dict]:
    """``count`` micro-batches of one sequence, each with a different number of label tokens."""
    generator = torch.Generator().manual_seed(step)
    batches = []
    for i in range(count):
        ids = torch.randint(3, vocab, (1, seq), generator=generator)
        labels = ids.clone()
        labels[:, : seq * i // (count + 1)] = -100  # a prompt whose tokens are not trained on
        batches.append({"input_ids": ids, "labels": labels})  # the same on every rank
    return batches


def train(steps: int, seq: int, accumulation: int) -> list[float]:
    mesh = cpshard.make_mesh(cp=int(os.environ["WORLD_SIZE"]))
    model = tiny_model("llama", num_hidden_layers=2)
    cp_forward = cpshard.make_cp_forward(model)
    params = cpshard.params_of(model)  # the model's own parameters: the optimizer updates them in place
    optimizer = torch.optim.AdamW(params.values(), lr=1e-3)
    losses = []
    for step in range(steps):
        batches = micro_batches(model.config.vocab_size, seq, accumulation, step)
        num_items = cpshard.count_label_tokens(batches, mesh)  # over every micro-batch (and dp group)
        total = 0.0
        for batch in batches:
            out = cp_forward(params, {**batch, "num_items_in_batch": num_items}, mesh)
            out.loss.backward()  # gradients add up in param.grad, already summed over the cp ranks
            total += out.loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)  # the loss of the step's whole batch
        if torch.distributed.get_rank() == 0:
            print(f"step {step}: loss {total:.4f} over {int(num_items)} label tokens", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--accumulation", type=int, default=3)
    args = parser.parse_args()
    if "RANK" in os.environ:
        train(args.steps, args.seq, args.accumulation)
        torch.distributed.destroy_process_group()
    else:
        cpshard.launch(train, args.steps, args.seq, args.accumulation, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
