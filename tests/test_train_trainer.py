"""examples/train_trainer.py: CPTrainer's example runs under cp=2 and saves a folder from_pretrained loads
(its exactness against one process's Trainer: tests/test_integrations_transformers.py)."""

import importlib.util
import math
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

PATH = Path(__file__).parents[1] / "examples" / "train_trainer.py"


def run_example(folder: str):
    spec = importlib.util.spec_from_file_location("train_trainer", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train(steps=2, seq=16, output_dir=folder)


@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="CPTrainer needs accelerate, the 'trainer' extra: pip install -e '.[trainer]'",
)
def test_the_example_trains_evaluates_and_saves(ranks2, tmp_path):
    first, second = ranks2.run(run_example, str(tmp_path))
    assert first["eval_loss"] == second["eval_loss"] and math.isfinite(first["eval_loss"]), (first, second)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 2
