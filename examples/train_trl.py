"""TRL's SFT and DPO under cp: ``CPSFTTrainer`` and ``CPDPOTrainer`` (``pip install 'cpshard[trl]'``).

    torchrun --nproc_per_node 2 examples/train_trl.py
    python examples/train_trl.py --nprocs 2

Each is TRL's trainer with its usual config, datasets and processing class, plus the mesh: each dp group
takes one shard of the data, every rank of a cp group the same batch, and the model (and DPO's reference
model) runs under cp. TRL's metrics (entropy, token accuracy, DPO's rewards and margins) are logged as TRL
logs them. Here a tiny Llama and a character tokenizer (no downloads) train on random text.
"""

import argparse
import os
import random
import string
import tempfile

import torch

import cpshard
from cpshard import tiny_model, tiny_tokenizer


def random_text(rows: int, length: int, seed: int) -> list[str]:
    """Rows of letters and spaces, characters the tiny tokenizer has one token for."""
    generator = random.Random(seed)
    return [
        "".join(generator.choices(string.ascii_lowercase + " ", k=generator.randint(length // 2, length)))
        for _ in range(rows)
    ]


def train(kind: str, steps: int, length: int, output_dir: str) -> dict:
    from datasets import Dataset
    from trl import DPOConfig, SFTConfig

    from cpshard.integrations.trl import CPDPOTrainer, CPSFTTrainer

    mesh = cpshard.make_mesh(cp=int(os.environ["WORLD_SIZE"]))
    model = tiny_model("llama", num_hidden_layers=2)
    prompts = random_text(16, length, seed=0)
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    if kind == "sft":
        data = Dataset.from_dict({"prompt": prompts, "completion": random_text(16, length, seed=1)})
        trainer = CPSFTTrainer(
            model, SFTConfig(**common), mesh=mesh, train_dataset=data, processing_class=tiny_tokenizer()
        )
    else:
        chosen, rejected = random_text(16, length, seed=2), random_text(16, length, seed=3)
        data = Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
        trainer = CPDPOTrainer(
            model,
            ref_model=tiny_model("llama", num_hidden_layers=2),  # the same weights: the policy's start
            args=DPOConfig(**common, beta=0.1),
            mesh=mesh,
            train_dataset=data,
            processing_class=tiny_tokenizer(),
        )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("sft", "dpo"), default="dpo")
    parser.add_argument("--nprocs", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--length", type=int, default=200, help="characters (tokens) per text, at most")
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "cpshard-trl"))
    args = parser.parse_args()
    call = (train, args.kind, args.steps, args.length, args.output_dir)
    if "RANK" in os.environ:
        print(call[0](*call[1:]))
        torch.distributed.destroy_process_group()
    else:
        print(cpshard.launch(*call, nprocs=args.nprocs)[0])


if __name__ == "__main__":
    main()
