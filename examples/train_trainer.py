"""transformers' Trainer under cp: ``CPTrainer`` (``pip install 'cpshard[trainer]'``).

    torchrun --nproc_per_node 2 examples/train_trainer.py
    python examples/train_trainer.py --nprocs 2

Everything is an ordinary ``Trainer`` (arguments, datasets, collator, gradient accumulation,
logging, evaluation, ``save_model``) but for the mesh: each dp group takes one shard of the
data, every rank of a cp group the same batch, and the loss is ``cp_forward``'s. With more ranks,
``cpshard.make_mesh(fsdp=2, cp=2)`` and ``cpshard.parallelize(model, mesh)`` first shard the weights.
"""

import argparse
import os
import tempfile

import torch
from transformers import TrainingArguments

import cpshard
from cpshard import tiny_model
from cpshard.integrations.transformers import CPTrainer


class RandomText(torch.utils.data.Dataset):
    """Rows of random token ids, labels the ids (the model shifts them)."""

    def __init__(self, rows: int, seq: int, vocab: int, seed: int):
        self.ids = torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def train(steps: int, seq: int, output_dir: str) -> dict:
    mesh = cpshard.make_mesh(cp=int(os.environ["WORLD_SIZE"]))
    model = tiny_model("llama", num_hidden_layers=2)
    vocab = model.config.vocab_size
    arguments = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    trainer = CPTrainer(
        model,
        arguments,
        mesh=mesh,
        train_dataset=RandomText(16, seq, vocab, seed=0),
        eval_dataset=RandomText(4, seq, vocab, seed=1),
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(output_dir)  # a folder AutoModelForCausalLM.from_pretrained loads
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "cpshard-trainer"))
    args = parser.parse_args()
    if "RANK" in os.environ:
        print(train(args.steps, args.seq, args.output_dir))
        torch.distributed.destroy_process_group()
    else:
        print(cpshard.launch(train, args.steps, args.seq, args.output_dir, nprocs=args.nprocs)[0])


if __name__ == "__main__":
    main()
