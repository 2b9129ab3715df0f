"""examples/train_accumulation.py: the loop runs under cp=2, the ranks agree, and its first step's loss is one
process's on the step's micro-batches together (the exactness of every gradient: tests/test_count.py)."""

import importlib.util
from pathlib import Path

import torch

import cpshard
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_model

PATH = Path(__file__).parents[1] / "examples" / "train_accumulation.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_accumulation", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example():
    return _example().train(steps=2, seq=24, accumulation=3)


def test_the_loop_runs_and_its_first_loss_is_one_process(ranks2):
    first, second = ranks2.run(run_example)
    model = tiny_model("llama", num_hidden_layers=2)
    batches = _example().micro_batches(model.config.vocab_size, 24, 3, step=0)
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    loss, _, _ = reference(model, cpshard.params_of(model), whole)
    assert first == second and len(first) == 2, (first, second)
    assert abs(first[0] - loss.item()) <= 1e-5, (first, loss)
