"""Functional training with cpshard, JAX style: value_and_grad of the cp forward, then AdamW
over the params pytree. Each step returns new params; nothing is changed in place.

    torchrun --nproc_per_node 2 examples/train_functional.py
    python examples/train_functional.py --nprocs 2

The sequence is split over every rank (a cp mesh); loss and gradients are exactly those of one
process on the whole sequence. AdamW is ``cpshard.adamw_update``: optree.tree_map over
params, grads and moments.
"""

import argparse
import os

import torch

import cpshard


def train(steps: int, seq: int, lr: float) -> float:
    mesh = cpshard.make_mesh(cp=int(os.environ["WORLD_SIZE"]))  # every rank on the cp axis
    model = cpshard.tiny_model("llama", num_hidden_layers=2)  # any transformers causal LM
    cp_forward = cpshard.make_cp_forward(model)
    step = cpshard.value_and_grad(cp_forward)

    tokens = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens, "labels": tokens}  # whole sequences, the same on every rank
    params = cpshard.params_of(model)
    opt_state = cpshard.adamw_init(params)
    for i in range(steps):
        output, grads = step(params, batch, mesh)
        params, opt_state = cpshard.adamw_update(params, grads, opt_state, lr=lr)
        if torch.distributed.get_rank() == 0:
            print(f"step {i}: loss {output.loss.item():.4f}", flush=True)
    return output.loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun (or another launcher): this process is one rank
        train(args.steps, args.seq, args.lr)
        torch.distributed.destroy_process_group()
    else:  # plain python: start the ranks here
        cpshard.launch(train, args.steps, args.seq, args.lr, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
