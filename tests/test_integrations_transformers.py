"""CPTrainer against one process's plain Trainer on the same data: the logged training losses, the eval
loss, the input tokens seen and the final weights (saved with save_pretrained) after a few steps of gradient
accumulation 2, under cp=2 (2 ranks) and fsdp2 x cp2 (4 ranks); Llama, and Qwen3-Next (a Gated DeltaNet
layer beside an attention layer) at cp=2; LoRA's adapters on Llama at cp=2 and tp=2."""

import importlib
import importlib.util
import sys
from types import MethodType

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import cpshard
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="CPTrainer needs accelerate, the 'trainer' extra: pip install -e '.[trainer]'",
)

VOCAB, LENGTH, ROWS = 130, 13, 16
STEPS, MICRO, ACCUMULATION = 3, 2, 2


class Rows(torch.utils.data.Dataset):
    """Rows of token ids with labels; some labels ignored, so micro-batches count different tokens."""

    def __init__(self, seed: int, rows: int):
        batch = tiny_batch(VOCAB, rows, LENGTH, pad="right", seed=seed)
        batch["labels"][::3, : LENGTH // 2] = -100
        self.rows = [{key: value[i] for key, value in batch.items()} for i in range(rows)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def _arguments(folder, batch_size: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=1e-3,
        adam_epsilon=1e-4,  # see tests/test_parallel.py: bounds fp32 rounding's effect on Adam's update
        logging_steps=1,
        train_sampling_strategy="sequential",
        save_strategy="no",
        include_num_input_tokens_seen="non_padding",
        report_to=[],
        use_cpu=True,
        seed=0,
    )


def _losses(trainer) -> dict:
    history = trainer.state.log_history
    return {
        "train": [entry["loss"] for entry in history if "loss" in entry],
        "eval": trainer.evaluate()["eval_loss"],
        "tokens seen": trainer.state.num_input_tokens_seen,
    }


def run_cp_trainer(sizes: dict, folder: str, model_type: str = "llama"):
    mesh = cpshard.make_mesh(**sizes)
    model = tiny_model(model_type, vocab_size=VOCAB)
    if len(sizes) > 1:
        cpshard.parallelize(model, mesh)
    from cpshard.integrations.transformers import CPTrainer

    trainer = CPTrainer(
        model, _arguments(folder, MICRO), mesh=mesh, train_dataset=Rows(1, ROWS), eval_dataset=Rows(2, 8)
    )
    trainer.train()
    losses = _losses(trainer)
    trainer.save_model(folder)
    weights = {
        n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()
    }
    return losses, weights


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The plain Trainer on one process, by dp-group count (its batch: every dp group's micro-batch)."""

    def train(groups: int, model_type: str = "llama"):
        model = tiny_model(model_type, vocab_size=VOCAB)
        # Trainer counts num_items_in_batch over labels[..., 1:] only for a loss_type it knows shifts them; a
        # causal LM whose class name it does not read as one (GPT-2's GPT2LMHeadModel: loss_type None) has its
        # rows' first labels counted too, so its loss is a little smaller than the mean. Named, the count is
        # the tokens the loss reads, as cp_forward's (the model's loss is the same function either way).
        assert model.loss_type in (None, "ForCausalLM"), model.loss_type
        model.loss_type = "ForCausalLM"
        arguments = _arguments(tmp_path_factory.mktemp("one"), MICRO * groups)
        trainer = Trainer(model, arguments, train_dataset=Rows(1, ROWS), eval_dataset=Rows(2, 8))
        trainer.train()
        return _losses(trainer), {n: p.detach() for n, p in model.named_parameters()}

    return train


def _compare(results, reference, folder, model_type: str = "llama"):
    (ref_losses, ref_weights) = reference
    saved = AutoModelForCausalLM.from_pretrained(folder)
    checks = {"saved": max((p - ref_weights[n]).abs().max().item() for n, p in saved.named_parameters())}
    initial = dict(tiny_model(model_type, vocab_size=VOCAB).named_parameters())
    moved = min((ref_weights[n] - p).abs().max().item() for n, p in initial.items())
    assert moved > 1e-4 and len(set(ref_losses["train"])) == STEPS, (moved, ref_losses)  # it trained
    for rank, (losses, weights) in enumerate(results):
        assert len(losses["train"]) == len(ref_losses["train"]) == STEPS, (losses, ref_losses)
        assert losses["tokens seen"] == ref_losses["tokens seen"] > 0, (losses, ref_losses)
        checks[f"rank {rank} train"] = max(abs(a - b) for a, b in zip(losses["train"], ref_losses["train"]))
        checks[f"rank {rank} eval"] = abs(losses["eval"] - ref_losses["eval"])
        checks[f"rank {rank} weights"] = max(
            (weights[n] - ref_weights[n]).abs().max().item() for n in weights
        )
    assert max(checks.values()) <= 1e-5, checks


@needs_accelerate
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen3_next", "nemotron_h"])
def test_cp_trainer_is_one_process_trainer_cp2(ranks2, one_process, tmp_path, model_type):
    results = ranks2.run(run_cp_trainer, dict(cp=2), str(tmp_path), model_type)
    _compare(results, one_process(1, model_type), tmp_path, model_type)


@needs_accelerate
def test_cp_trainer_is_one_process_trainer_fsdp2xcp2(ranks4, one_process, tmp_path):
    _compare(ranks4.run(run_cp_trainer, dict(fsdp=2, cp=2), str(tmp_path)), one_process(2), tmp_path)


def _lora_llama():
    """The tiny Llama with LoRA on q, v and down (B drawn, not zeros: the adapters change the output), alike
    on every rank."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    config.init_lora_weights = False
    return get_peft_model(tiny_model("llama", vocab_size=VOCAB), config).get_base_model()


def _trained_adapters(trainer) -> tuple[list, dict]:
    """The logged training losses and the adapters' weights (whole) after ``trainer.train()``."""
    trainer.train()
    weights = {
        n: p.full_tensor() if isinstance(p, DTensor) else p.detach()
        for n, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], weights


def cp_trained_lora(sizes: dict, folder: str) -> tuple[list, dict]:
    mesh, model = cpshard.make_mesh(**sizes), _lora_llama()
    if set(sizes) != {"cp"}:
        cpshard.parallelize(model, mesh)
    from cpshard.integrations.transformers import CPTrainer

    trainer = CPTrainer(model, _arguments(folder, MICRO), mesh=mesh, train_dataset=Rows(1, ROWS))
    return _trained_adapters(trainer)


@needs_accelerate
@pytest.mark.parametrize("sizes", [dict(cp=2), dict(cp=1, tp=2)])
def test_cp_trainer_trains_lora_adapters_as_one_process_trainer(ranks2, tmp_path, sizes):
    own = Trainer(_lora_llama(), _arguments(tmp_path / "one", MICRO), train_dataset=Rows(1, ROWS))
    own_losses, own_weights = _trained_adapters(own)
    initial = dict(_lora_llama().named_parameters())
    assert min((own_weights[n] - initial[n]).abs().max().item() for n in own_weights) > 1e-4  # it trained
    assert own_weights and all(".lora_" in n for n in own_weights), sorted(own_weights)
    for losses, weights in ranks2.run(cp_trained_lora, sizes, str(tmp_path / "cp")):
        assert len(losses) == len(own_losses) == STEPS, (losses, own_losses)
        assert max(abs(a - b) for a, b in zip(losses, own_losses)) <= 1e-5, (losses, own_losses)
        assert sorted(weights) == sorted(own_weights)
        assert max((weights[n] - own_weights[n]).abs().max().item() for n in weights) <= 1e-5


def _one_epoch(folder, batch_size: int) -> TrainingArguments:
    """One epoch of plain SGD in batches of ``batch_size``, in the data's order."""
    return TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=batch_size,
        num_train_epochs=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
    )


def trained_on_rows(folder: str, rows: int, batch: int, sizes: dict | None = None):
    """The losses and weights after one epoch over ``rows`` rows: the plain Trainer on one process in
    batches of ``2 * batch``, or CPTrainer on ``sizes`` (two dp groups) in batches of ``batch`` per group."""
    from cpshard.integrations.transformers import CPTrainer

    model = tiny_model("llama", vocab_size=VOCAB)
    model.loss_type = "ForCausalLM"
    if sizes is None:
        trainer = Trainer(model, _one_epoch(folder, 2 * batch), train_dataset=Rows(1, rows))
    else:
        mesh = cpshard.make_mesh(**sizes)
        cpshard.parallelize(model, mesh)
        trainer = CPTrainer(model, _one_epoch(folder, batch), mesh=mesh, train_dataset=Rows(1, rows))
    trainer.train()
    weights = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {n: p.detach() for n, p in weights.items()}


@needs_accelerate
@pytest.mark.parametrize("batch, steps", [(1, 4), (2, 2)])
def test_training_rows_the_dp_groups_do_not_divide_are_each_trained_once(ranks4, tmp_path, batch, steps):
    """Two dp groups and 7 rows: the sampler evens the shards out with a repeat of row 0, which the last step
    trained beside row 6 (silently, before: its loss 1.4 from one process's); the repeat has no labels
    now, and each step is one process's. In batches of 2 the repeat is the last batch's second row."""
    ref_losses, ref_weights = trained_on_rows(str(tmp_path / "one"), 7, batch)
    assert len(ref_losses) == steps
    for losses, weights in ranks4.run(trained_on_rows, str(tmp_path), 7, batch, dict(fsdp=2, cp=2)):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-5, (losses, ref_losses)
        assert max((weights[n] - ref_weights[n]).abs().max().item() for n in weights) <= 1e-5


def _flattened(rows: list) -> dict:
    """A padding-free collator's batch: the rows in one, their positions restarting at each."""
    return {
        "input_ids": torch.cat([row["input_ids"] for row in rows])[None],
        "labels": torch.cat([row["labels"] for row in rows])[None],
        "position_ids": torch.cat([torch.arange(len(row["input_ids"])) for row in rows])[None],
    }


def training_loader_of_rows(folder: str, rows: int, collator) -> str:
    from cpshard.integrations.transformers import CPTrainer

    mesh, model = cpshard.make_mesh(fsdp=2, cp=2), tiny_model("llama", vocab_size=VOCAB)
    cpshard.parallelize(model, mesh)
    arguments = _one_epoch(folder, 2)
    trainer = CPTrainer(model, arguments, mesh=mesh, train_dataset=Rows(1, rows), data_collator=collator)
    try:
        trainer.get_train_dataloader()
    except ValueError as error:
        return str(error)
    return "accepted"


@needs_accelerate
def test_a_padding_free_collator_with_rows_the_dp_groups_do_not_divide_is_refused(ranks4, tmp_path):
    """Its batch is one row, whose repeated part the loader cannot take the labels from: refused on every rank
    before training (the loader raised an IndexError on the ranks of one dp group, at the epoch's end)."""
    expected = "7 training rows do not divide over 2 dp groups"
    for message in ranks4.run(training_loader_of_rows, str(tmp_path), 7, _flattened):
        assert expected in message and "packed in one" in message, message
    assert ranks4.run(training_loader_of_rows, str(tmp_path), 8, _flattened) == ["accepted"] * 4


def test_without_accelerate_the_import_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "cpshard.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'cpshard\[trainer\]'"):
        importlib.import_module("cpshard.integrations.transformers")


def run_unsupported(folder: str):
    from cpshard.integrations.transformers import CPTrainer

    arguments = _arguments(folder, MICRO)
    arguments.label_smoothing_factor = 0.1
    CPTrainer(tiny_model("llama", vocab_size=VOCAB), arguments, mesh=cpshard.make_mesh(cp=2))


@needs_accelerate
def test_what_it_does_not_support_is_an_error(ranks2, tmp_path):
    with pytest.raises(cpshard.RankError) as caught:
        ranks2.run(run_unsupported, str(tmp_path))
    assert sorted(caught.value.failures) == [0, 1]
    assert "does not take label_smoothing_factor" in caught.value.failures[0].message


def run_under_accelerate_mixed_precision(model_type: str) -> dict:
    """A model whose forward is wrapped as accelerate's ``prepare_model`` wraps it for bf16 mixed precision
    (Trainer's bf16=True on a GPU: autocast, outputs to fp32; written out here, since the process's
    AcceleratorState is the other tests' Trainers'), trained through cp_forward: its loss and worst gradient
    against one process's through the same wrapper, relative to their scales."""
    from accelerate.utils import convert_outputs_to_fp32

    model = tiny_model(model_type)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model.forward = MethodType(convert_outputs_to_fp32(autocast(type(model).forward)), model)
    batch, mesh = tiny_batch(model.config.vocab_size, 2, LENGTH), cpshard.make_mesh(cp=2)
    params = cpshard.params_of(model)
    output, grads = cpshard.value_and_grad(cpshard.make_cp_forward(model))(params, batch, mesh)
    loss, logits, one_process = reference(model, params, batch)
    with torch.no_grad():
        unwrapped = type(model).forward(model, **batch, use_cache=False).logits
    return {
        "loss": float((output.loss - loss).abs() / loss.abs()),
        "grads": max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in one_process.items()),
        "autocast": float((logits - unwrapped).abs().max() / unwrapped.abs().max()),
    }


@needs_accelerate
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])  # a registered layout, and a probed one
def test_accelerate_s_mixed_precision_is_one_process_s(ranks2, model_type):
    """Under autocast cpshard's loss raised deep in its backward (and a probed layout was blamed), then it
    was refused; autocast that accelerate puts around the model's forward is now served: the probe sees it
    where the decoder runs and takes its second look in float64, which autocast leaves alone."""
    for differences in ranks2.run(run_under_accelerate_mixed_precision, model_type):
        assert differences["autocast"] > 1e-3, differences  # the wrapper's autocast acted
        assert differences["loss"] < 1e-3 and differences["grads"] < 5e-2, differences


def run_shuffled_orders():
    from cpshard.integrations.transformers import CPTrainer

    mesh = cpshard.make_mesh(fsdp=2, cp=2)
    arguments = _arguments("unused", MICRO)
    arguments.train_sampling_strategy = "random"
    trainer = CPTrainer(
        tiny_model("llama", vocab_size=VOCAB), arguments, mesh=mesh, train_dataset=Rows(1, ROWS)
    )
    loader = trainer.get_train_dataloader()
    orders = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        orders.append(torch.cat([batch["input_ids"][:, 0] for batch in loader]).tolist())
    return mesh.get_local_rank("fsdp"), orders


@needs_accelerate
def test_each_dp_group_its_own_shard_the_same_on_its_ranks_reshuffled_each_epoch(ranks4):
    by_group = {}
    for group, orders in ranks4.run(run_shuffled_orders):
        assert by_group.setdefault(group, orders) == orders  # the ranks of a dp group: the same batches
        assert orders[0] != orders[1], orders  # another order each epoch
    every = sorted(row["input_ids"][0].item() for row in Rows(1, ROWS).rows)
    for epoch in (0, 1):  # the two dp groups: halves of the data, together all of it
        first, second = by_group[0][epoch], by_group[1][epoch]
        assert len(first) == len(second) == ROWS // 2 and sorted(first + second) == every


def token_accuracy(prediction) -> dict:
    """A metric of the predictions (next-token accuracy over labelled tokens) and how many rows it saw."""
    picked, target = prediction.predictions[:, :-1].argmax(-1), prediction.label_ids[:, 1:]
    valid = target != -100
    return {"accuracy": float((picked == target)[valid].mean()), "rows": len(target)}


def evaluated(trainer) -> dict:
    """``evaluate()``'s metrics with ``compute_metrics``, and ``predict()``'s logits on another set."""
    metrics = trainer.evaluate()
    predicted = trainer.predict(Rows(3, 6))
    return {
        "metrics": {key: metrics[key] for key in ("eval_loss", "eval_accuracy", "eval_rows")},
        "predictions": torch.as_tensor(predicted.predictions),
        "labels": torch.as_tensor(predicted.label_ids),
    }


def cp_evaluation(sizes: dict, folder: str, rows: int) -> dict:
    from cpshard.integrations.transformers import CPTrainer

    mesh = cpshard.make_mesh(**sizes)
    model = tiny_model("llama", vocab_size=VOCAB)
    arguments = _arguments(folder, MICRO)
    trainer = CPTrainer(
        model, arguments, mesh=mesh, eval_dataset=Rows(2, rows), compute_metrics=token_accuracy
    )
    return evaluated(trainer)


@needs_accelerate
@pytest.mark.ranks  # its ranks come through getfixturevalue, which the marker's hook does not see
@pytest.mark.parametrize(
    "sizes, rows",
    [(dict(cp=2), 8), (dict(cp=2), 7), (dict(fsdp=2, cp=2), 8), (dict(fsdp=2, cp=2), 6)],
    ids=["cp2", "cp2-last-batch-short", "fsdp2xcp2", "fsdp2xcp2-last-batches-short"],
)
def test_metrics_and_predictions_are_the_plain_trainer_s(request, tmp_path, sizes, rows):
    """Each dp group's predictions once (not cp times), the logits whole: evaluate's loss and metrics and
    predict's logits as one process's Trainer gives them (predictions in its order where one dp group).
    A last batch shorter than the batch size counts its loss once per row, as Trainer's (7 rows in batches
    of 2; 6 rows over two dp groups in batches of 2 each, one process's of 4)."""
    groups = sizes.get("fsdp", 1)
    ranks = request.getfixturevalue("ranks4" if groups > 1 else "ranks2")
    model = tiny_model("llama", vocab_size=VOCAB)
    plain = Trainer(
        model,
        _arguments(tmp_path / "one", MICRO * groups),
        eval_dataset=Rows(2, rows),
        compute_metrics=token_accuracy,
    )
    expected = evaluated(plain)
    for result in ranks.run(cp_evaluation, sizes, str(tmp_path), rows):
        assert result["metrics"]["eval_rows"] == expected["metrics"]["eval_rows"] == rows, result["metrics"]
        for key, value in expected["metrics"].items():
            assert abs(result["metrics"][key] - value) <= 1e-5, (key, result["metrics"], expected["metrics"])
        if groups == 1:
            assert torch.equal(result["labels"], expected["labels"])
            assert (result["predictions"] - expected["predictions"]).abs().max() <= 1e-5
        else:  # the dp groups' shards interleave the rows: the same rows, another order
            assert result["predictions"].shape == expected["predictions"].shape


def evaluation_of_rows(rows: int, folder: str) -> str:
    from cpshard.integrations.transformers import CPTrainer

    model, mesh = tiny_model("llama", vocab_size=VOCAB), cpshard.make_mesh(fsdp=2, cp=2)
    trainer = CPTrainer(model, _arguments(folder, MICRO), mesh=mesh, eval_dataset=Rows(2, rows))
    try:
        return str(trainer.evaluate()["eval_loss"])
    except ValueError as error:
        return str(error)


@needs_accelerate
def test_evaluation_rows_the_dp_groups_do_not_divide_are_refused_on_every_rank(ranks4, tmp_path):
    """Two dp groups and 7 rows: the sampler would repeat one, counted twice (silently, before)."""
    for message in ranks4.run(evaluation_of_rows, 7, str(tmp_path)):
        assert "7 evaluation rows do not divide over 2 dp groups" in message, message


def resumed_run(folder: str, sizes: dict, rows: int = ROWS) -> dict:
    """Four steps on shuffled data saving every two, then the same run resumed from its step-2 checkpoint
    (model, AdamW, schedule, RNG, data position) in another folder: their losses and final weights. With
    an fsdp or tp axis the model is parallelized: its AdamW state is every rank's own shards."""
    from cpshard.integrations.transformers import CPTrainer

    runs = {}
    for name, resume in (("whole", None), ("resumed", f"{folder}/whole/checkpoint-2")):
        mesh, model = cpshard.make_mesh(**sizes), tiny_model("llama", vocab_size=VOCAB)
        if len(sizes) > 1:
            cpshard.parallelize(model, mesh)
        arguments = _arguments(f"{folder}/{name}", MICRO)
        arguments.max_steps, arguments.save_steps, arguments.save_strategy = 4, 2, "steps"
        arguments.train_sampling_strategy = "random"
        trainer = CPTrainer(model, arguments, mesh=mesh, train_dataset=Rows(1, rows))
        trainer.train(resume_from_checkpoint=resume)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        whole = {
            n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for n, p in model.named_parameters()
        }
        runs[name] = (losses, whole)
    (whole, first), (resumed, second) = runs["whole"], runs["resumed"]
    return {
        "losses": (whole, resumed),
        "weights": max((first[n] - second[n]).abs().max().item() for n in first),
    }


@needs_accelerate
@pytest.mark.ranks  # its ranks come through getfixturevalue, which the marker's hook does not see
@pytest.mark.parametrize(
    "sizes, rows",
    [(dict(cp=2), ROWS), (dict(fsdp=2, cp=2), ROWS), (dict(cp=2, tp=2), ROWS), (dict(fsdp=2, cp=2), 23)],
    ids=["cp2", "fsdp2xcp2", "cp2xtp2", "fsdp2xcp2-mid-epoch-repeat"],
)
def test_a_checkpoint_resumes_as_the_uninterrupted_run(request, tmp_path, sizes, rows):
    """23 rows over two dp groups: three steps an epoch, so the step-2 checkpoint resumes mid-epoch, and the
    epoch's last batch holds a repeat (its labels dropped in the resumed run too)."""
    ranks = request.getfixturevalue("ranks4" if len(sizes) > 1 else "ranks2")
    for result in ranks.run(resumed_run, str(tmp_path), sizes, rows):
        whole, resumed = result["losses"]
        assert len(whole) == len(resumed) == 4 and result["weights"] <= 1e-6, result
        assert max(abs(a - b) for a, b in zip(whole, resumed)) <= 1e-6, result
