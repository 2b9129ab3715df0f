"""Long-context generation under cp: the prompt is prefilled with its sequence split over the ranks into a
KV cache that stays split, then each new token attends with every rank's share of the cache.

    torchrun --nproc_per_node 2 examples/generate.py
    python examples/generate.py --nprocs 2
    python examples/generate.py --model qwen3_next  # a hybrid: its linear layers carry their states

The tokens are those of one process's ``model.generate(do_sample=False)``, on every rank; each rank holds
about 1/cp of the cache.
"""

import argparse
import os

import torch

import cpshard


def generate(prompt: int, new: int, model_type: str = "llama") -> torch.Tensor:
    mesh = cpshard.make_mesh(cp=int(os.environ["WORLD_SIZE"]))  # every rank on the cp axis
    model = cpshard.tiny_model(model_type)  # any transformers causal LM cpshard serves
    ids = torch.randint(3, model.config.vocab_size, (2, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, : prompt // 3] = 0  # the second prompt is shorter: left-padded (right padding: attention only)
    batch = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}  # the same on every rank

    tokens = cpshard.generate(model, batch, mesh, max_new_tokens=new)  # greedy; do_sample=True, top_p=...

    # the same, step by step: a functional prefill, then one token per row per decode step
    params = cpshard.params_of(model)
    cp_prefill, cp_decode = cpshard.make_cp_prefill(model), cpshard.make_cp_decode(model)
    logits, cache = cp_prefill(params, batch, mesh)  # logits of each row's last token; the split cache
    for column in range(prompt, prompt + 4):
        assert torch.equal(logits.argmax(-1), tokens[:, column])
        logits, cache = cp_decode(params, tokens[:, column], cache, mesh)
    if torch.distributed.get_rank() == 0:
        with torch.no_grad():
            reference = model.generate(**batch, max_new_tokens=new, do_sample=False)
        print(f"new tokens, row 0: {tokens[0, prompt:].tolist()}")
        print(f"the same as one process's model.generate: {torch.equal(tokens, reference)}")
        print(f"KV cache on rank 0: {cache.nbytes:,} bytes of {cache.length} tokens", flush=True)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="new tokens")
    parser.add_argument("--model", default="llama", help="a model type, built tiny and random")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun (or another launcher): this process is one rank
        generate(args.prompt, args.new, args.model)
        torch.distributed.destroy_process_group()
    else:  # plain python: start the ranks here
        cpshard.launch(generate, args.prompt, args.new, args.model, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
