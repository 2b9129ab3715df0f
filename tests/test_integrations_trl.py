"""TRL's SFT and DPO trainers under cp (cpshard.integrations.trl) against the same TRL trainer on one process
with the same data: every logged loss and metric (TRL's entropy, token accuracy, tokens, DPO's rewards,
margins and log-probabilities) and the final weights, after three steps of gradient accumulation 2, at cp=2
(2 ranks) and fsdp2 x cp2 (4 ranks: two dp groups); DPO also with two losses, WPO weighting and LD-DPO's
alpha. A TRL trainer mixed into CPTrainer by hand, and what is not served, refused on every rank; the
example runs."""

import importlib.util
import math
import random
from pathlib import Path

import pytest
from torch.distributed.tensor import DTensor

import cpshard
from cpshard.tools.tiny import TINY_CHARACTERS, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None,
    reason="the TRL trainers need trl, the 'trl' extra: pip install -e '.[trl]'",
)

VOCAB, ROWS, MICRO, STEPS = 40, 8, 2, 3


def _text(generator: random.Random, low: int, high: int) -> str:
    return "".join(generator.choice(TINY_CHARACTERS) for _ in range(generator.randint(low, high)))


def dataset(kind: str, seed: int, rows: int = ROWS):
    """Prompt-completion rows for SFT (the loss on the completion only) or preference pairs for DPO, of
    different lengths (padding, and cp padding at odd lengths)."""
    from datasets import Dataset

    generator = random.Random(seed)
    prompts = [_text(generator, 5, 15) for _ in range(rows)]
    if kind == "sft":
        return Dataset.from_dict(
            {"prompt": prompts, "completion": [_text(generator, 4, 20) for _ in prompts]}
        )
    chosen, rejected = ([_text(generator, 3, 14) for _ in prompts] for _ in range(2))
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def _config(kind: str, folder: str, batch_size: int, **options):
    from trl import DPOConfig, SFTConfig

    common = dict(
        output_dir=folder,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        adam_epsilon=1e-4,  # see tests/test_parallel.py: bounds fp32 rounding's effect on Adam's update
        logging_steps=1,
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    config = SFTConfig if kind == "sft" else DPOConfig
    return config(**common, **options)


def _trainer(kind: str, model, config, **extra):
    return dict(
        args=config,
        train_dataset=dataset(kind, 1),
        eval_dataset=dataset(kind, 2),
        processing_class=tiny_tokenizer(),
        **({"ref_model": tiny_model("llama", vocab_size=VOCAB)} if kind == "dpo" else {}),
        **extra,
    )


def _logged(trainer) -> dict:
    """The numbers of every training log entry, and evaluate()'s."""
    history = [
        {key: value for key, value in entry.items() if isinstance(value, float | int)}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    return {"train": history, "eval": trainer.evaluate()}


def run_cp(kind: str, sizes: dict, folder: str, options: dict, forward: dict):
    from cpshard.integrations.trl import CPDPOTrainer, CPSFTTrainer

    mesh = cpshard.make_mesh(**sizes)
    model = tiny_model("llama", vocab_size=VOCAB)
    if len(sizes) > 1:
        cpshard.parallelize(model, mesh)
    trainer_class = CPSFTTrainer if kind == "sft" else CPDPOTrainer
    config = _config(kind, folder, MICRO, **options)
    trainer = trainer_class(model, mesh=mesh, forward=forward, **_trainer(kind, model, config))
    trainer.train()
    weights = {
        n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()
    }
    return _logged(trainer), weights


def one_process(kind: str, groups: int, folder: str, options: dict):
    from trl import DPOTrainer, SFTTrainer

    model = tiny_model("llama", vocab_size=VOCAB)
    config = _config(kind, folder, MICRO * groups, **options)
    trainer = (SFTTrainer if kind == "sft" else DPOTrainer)(model, **_trainer(kind, model, config))
    trainer.train()
    return _logged(trainer), {n: p.detach() for n, p in model.named_parameters()}


def _compare(results, reference, metrics: set):
    (expected, ref_weights) = reference
    initial = dict(tiny_model("llama", vocab_size=VOCAB).named_parameters())
    assert min((ref_weights[n] - p).abs().max().item() for n, p in initial.items()) > 1e-4  # it trained
    assert len(expected["train"]) == STEPS and metrics <= set(expected["train"][0]), expected["train"][0]
    for rank, (logged, weights) in enumerate(results):
        checks = {"weights": max((weights[n] - ref_weights[n]).abs().max().item() for n in weights)}
        assert [set(entry) for entry in logged["train"]] == [set(entry) for entry in expected["train"]]
        for step, (got, want) in enumerate(zip(logged["train"], expected["train"])):
            for key in metrics:
                checks[f"{key} {step}"] = abs(got[key] - want[key]) / max(1.0, abs(want[key]))
        for key, value in expected["eval"].items():
            if key.startswith("eval_") and "runtime" not in key and "per_second" not in key:
                checks[key] = abs(logged["eval"][key] - value) / max(1.0, abs(value))
        assert max(checks.values()) <= 1e-5, (rank, {k: v for k, v in checks.items() if v > 1e-5})


SFT_METRICS = {"loss", "entropy", "mean_token_accuracy", "num_tokens", "grad_norm"}
DPO_METRICS = SFT_METRICS - {"grad_norm"} | {
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
}


@pytest.mark.ranks
@pytest.mark.parametrize(
    "kind, sizes, options, forward",
    [
        ("sft", dict(cp=2), {}, {}),
        ("sft", dict(fsdp=2, cp=2), {}, dict(logits=False)),
        ("sft", dict(cp=2), dict(loss_type="dft"), {}),
        ("sft", dict(cp=2), dict(packing=True, max_length=40), dict(implementation="ring")),
        ("dpo", dict(cp=2), {}, {}),
        ("dpo", dict(fsdp=2, cp=2), {}, dict(logits=False)),
        (
            "dpo",
            dict(cp=2),
            dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5], use_weighting=True),
            {},
        ),
        ("dpo", dict(cp=2), dict(loss_type=["hinge", "sft"], ld_alpha=0.5), dict(logits=False)),
    ],
    ids=[
        "sft-cp2",
        "sft-fsdp2xcp2-nologits",
        "sft-dft-cp2",
        "sft-packed-ring-cp2",
        "dpo-cp2",
        "dpo-fsdp2xcp2-nologits",
        "dpo-ipo-wpo-cp2",
        "dpo-hinge-sft-ld-nologits-cp2",
    ],
)
def test_a_trl_trainer_under_cp_is_the_same_trainer_on_one_process(
    request, tmp_path, kind, sizes, options, forward
):
    groups = sizes.get("fsdp", 1)
    ranks = request.getfixturevalue("ranks4" if groups > 1 else "ranks2")
    results = ranks.run(run_cp, kind, sizes, str(tmp_path / "cp"), options, forward)
    reference = one_process(kind, groups, str(tmp_path / "one"), options)
    _compare(results, reference, SFT_METRICS if kind == "sft" else DPO_METRICS)


PEFT_CASES = ("peft model", "peft_config")


def run_refused(case: str, folder: str) -> str:
    from peft import LoraConfig, get_peft_model
    from trl import GRPOTrainer, SFTTrainer

    from cpshard.integrations.transformers import CPTrainer
    from cpshard.integrations.trl import CPDPOTrainer, CPSFTTrainer

    mesh, model = cpshard.make_mesh(cp=2), tiny_model("llama", vocab_size=VOCAB)
    trainers = {
        "sft mixin": type("Mixed", (CPTrainer, SFTTrainer), {}),
        "grpo mixin": type("Mixed", (CPTrainer, GRPOTrainer), {}),
    }
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    try:
        if case in trainers:
            trainers[case](model, _config("sft", folder, MICRO), mesh=mesh)
        elif case == "peft model":
            CPSFTTrainer(get_peft_model(model, lora), _config("sft", folder, MICRO), mesh=mesh)
        elif case == "peft_config":
            CPSFTTrainer(model, _config("sft", folder, MICRO), mesh=mesh, peft_config=lora)
        else:
            config = _config("dpo", folder, MICRO, precompute_ref_log_probs=True)
            CPDPOTrainer(model, mesh=mesh, **_trainer("dpo", model, config))
    except (TypeError, ValueError) as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "sft mixin",
            "mixes CPTrainer with TRL's SFTTrainer, whose loss and metrics come from a fused LM head",
        ),
        ("grpo mixin", "TRL's other trainers (GRPO, RLOO, KTO, ...) are not served yet"),
        ("precompute", "precompute_ref_log_probs=True reads the data with a loader that splits its rows"),
        *((case, "a PEFT model (or peft_config) is not served by cpshard's trainers") for case in PEFT_CASES),
    ],
)
def test_what_is_not_served_is_refused_on_every_rank(ranks2, tmp_path, case, message):
    for got in ranks2.run(run_refused, case, str(tmp_path)):
        assert message in got, got


def uneven_pairs(folder: str) -> str:
    """Seven preference pairs over two dp groups (fsdp2 x cp2): the loader CPDPOTrainer would train on."""
    from cpshard.integrations.trl import CPDPOTrainer

    mesh, model = cpshard.make_mesh(fsdp=2, cp=2), tiny_model("llama", vocab_size=VOCAB)
    cpshard.parallelize(model, mesh)
    arguments = {**_trainer("dpo", model, _config("dpo", folder, 1)), "train_dataset": dataset("dpo", 1, 7)}
    try:
        CPDPOTrainer(model, mesh=mesh, **arguments).get_train_dataloader()
    except ValueError as error:
        return str(error)
    return "accepted"


def test_preference_pairs_the_dp_groups_do_not_divide_are_refused_on_every_rank(ranks4, tmp_path):
    """DPO's loss is each dp group's mean over its pairs: a pair the sampler repeats to even out the groups'
    shards (trained twice, silently, before) cannot be taken out of it by its labels, as CPTrainer's rows
    are."""
    for message in ranks4.run(uneven_pairs, str(tmp_path)):
        assert "CPDPOTrainer: 7 training pairs do not divide over 2 dp groups" in message, message


EXAMPLE = Path(__file__).parents[1] / "examples" / "train_trl.py"


def run_example(kind: str, folder: str) -> dict:
    spec = importlib.util.spec_from_file_location("train_trl", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train(kind, steps=2, length=24, output_dir=folder)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_the_example_trains(ranks2, tmp_path, kind):
    first, second = ranks2.run(run_example, kind, str(tmp_path))
    assert first == second and math.isfinite(first["loss"]) and first["step"] == 2, (first, second)
