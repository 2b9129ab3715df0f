"""Verify before trusting: a layout that is not a tested file is probed once, and a mismatch is an error
on every rank naming the first layer that differs."""

import re
from functools import partial

import pytest
import torch
import transformers

import cpshard
from cpshard.call import split_call
from cpshard.layouts.decoder import LAYOUT as DECODER
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model


def run_probe_case(kind: str):
    model = tiny_model("gpt_oss" if kind == "sinks-ring" else "llama", attn_implementation="auto")
    batch = tiny_batch(model.config.vocab_size, 2, 9)
    mesh = cpshard.make_mesh(cp=2)
    if kind == "sinks-ring":
        forward = cpshard.make_cp_forward(model, implementation="ring")
        return forward(cpshard.params_of(model), batch, mesh)
    forward = cpshard.make_cp_forward(model, layout=DECODER.with_rows(name="renamed"))
    return failing_rows([check_parity(model, batch, mesh, forward)])


CASES = {
    "sinks-ring": "the ring's merge has no place for the per-head parameters ('sinks',)",
}


@pytest.mark.parametrize("kind", CASES)
def test_a_layout_cp_cannot_vouch_for_fails_on_every_rank(ranks2, kind):
    with pytest.raises(cpshard.RankError) as caught:
        ranks2.run(run_probe_case, kind)
    failures = caught.value.failures
    assert sorted(failures) == [0, 1]
    for failure in failures.values():
        assert failure.kind == "LayoutError" and CASES[kind] in failure.message, failure.message


def failing_under_cp(module, args):
    if split_call() is not None:
        raise TypeError("forward() missing 1 required positional argument: 'alibi'")


def probe_with(hook, module: str) -> str:
    """The probe's message for a model with ``hook`` on ``module``: code that raises under cp alone (as
    Falcon's rewrite did on transformers 5.25), or the model's own code that raises with or without cp."""
    model = tiny_model("llama", attn_implementation="auto")
    model.get_submodule(module).register_forward_pre_hook(hook)
    return probe_message(model, cpshard.make_cp_forward(model, layout=DECODER.with_rows(name="renamed")))


def probe_message(model, forward) -> str:
    """The probe's LayoutError message at ``forward``'s first call on a 9-token batch at cp=2."""
    try:
        forward(cpshard.params_of(model), tiny_batch(model.config.vocab_size, 2, 9), cpshard.make_mesh(cp=2))
    except cpshard.LayoutError as error:
        return str(error)
    return "no error"


def test_an_error_in_the_probes_cp_run_is_named_not_blamed_on_token_mixing(ranks2):
    for message in ranks2.run(probe_with, failing_under_cp, "model.layers.1"):
        assert "its cp run raised TypeError: forward() missing 1 required" in message, message
        assert "test_probe.py" in message and "failing_under_cp" in message, message
        assert "installed transformers" in message and "mixes tokens" not in message, message


def reading_a_missing_field(module, args):
    raise AttributeError("'LlamaConfig' object has no attribute 'router_aux_loss_coef'")


def test_an_error_of_the_model_alone_is_named_as_the_model_s(ranks2):
    for message in ranks2.run(probe_with, reading_a_missing_field, "model.layers.1.mlp"):
        assert "the model's own forward, in one process without cp, raised AttributeError" in message, message
        assert "router_aux_loss_coef" in message and "reading_a_missing_field" in message, message
        assert "cp run" not in message and "mixes tokens" not in message, message


def out_of_memory_on_rank_1(stage: str, module, args):
    """A pre-hook whose one-process reference runs out of memory on cp rank 1 alone, in the probe's forward
    (run without gradient) or its gradient: the other rank must not wait for it in the probe's collectives."""
    in_stage = torch.is_grad_enabled() == (stage == "gradient")
    if split_call() is None and in_stage and torch.distributed.get_rank() == 1:
        raise MemoryError("out of memory in the reference")


def test_a_reference_failing_on_one_rank_fails_every_rank_without_a_hang(ranks2):
    for stage in ("forward", "gradient"):
        first, second = ranks2.run(probe_with, partial(out_of_memory_on_rank_1, stage), "model.layers.0")
        assert "reference raised on cp rank 1 (its error, raised there" in first, (stage, first)
        assert "without cp, raised MemoryError: out of memory in the reference" in second, (stage, second)


def test_a_right_layout_passes_the_probe_and_stays_exact(ranks2):
    assert ranks2.run(run_probe_case, "right") == [[], []]


def probed_with_token_outputs() -> list[str]:
    """A derived layout (GPT-2's) whose cp forward also gives token log-probabilities and statistics."""
    model = tiny_model("gpt2")
    batch = tiny_batch(model.config.vocab_size, 2, 9)
    forward = cpshard.make_cp_forward(model, token_logprobs=True, token_statistics=("entropy",))
    return failing_rows([check_parity(model, batch, cpshard.make_mesh(cp=2), forward)])


def test_the_probe_serves_a_forward_that_gives_token_outputs(ranks2):
    """The probe's cp run had no labels, so token_logprobs or token_statistics refused every derived layout
    ("token_logprobs needs labels"), whatever the call's batch held."""
    assert ranks2.run(probed_with_token_outputs) == [[], []]


def parallelized_unverified(forward_first: bool):
    model = tiny_model("qwen2")
    forward = cpshard.make_cp_forward(model) if forward_first else None
    mesh = cpshard.make_mesh(fsdp=2, cp=2)
    params = cpshard.params_of(cpshard.parallelize(model, mesh))
    forward = forward or cpshard.make_cp_forward(model)
    return forward(params, tiny_batch(model.config.vocab_size, 2, 9), mesh)


@pytest.mark.parametrize(
    "forward_first, says",
    [
        (True, "verified on the plain model's parameters only"),
        # the layout derived from a run on DTensor parameters: it failed inside the model, and the error
        # blamed the model ("does not run on token ids and labels alone")
        (False, "from a run of the model on its plain parameters, and they are DTensors now"),
    ],
)
def test_a_parallelized_model_with_an_unverified_layout_is_refused(ranks4, forward_first, says):
    with pytest.raises(cpshard.RankError) as caught:
        ranks4.run(parallelized_unverified, forward_first)
    failures = caught.value.failures
    assert sorted(failures) == [0, 1, 2, 3]
    for failure in failures.values():
        assert failure.kind == "LayoutError" and says in failure.message, failure.message
        assert "params_of(model)" in failure.message and "cpshard.make_mesh(cp=...)" in failure.message


def parallelized_after_the_probe():
    """The way the refusal names: one call on the plain parameters probes the layout, then the parallel
    parameters run and give the plain parameters' loss (every dp group holds the same batch here)."""
    model = tiny_model("qwen2")
    batch = tiny_batch(model.config.vocab_size, 2, 9)
    forward = cpshard.make_cp_forward(model)
    mesh = cpshard.make_mesh(fsdp=2, cp=2)
    plain = forward(cpshard.params_of(model), batch, mesh).loss.item()
    parallel = forward(cpshard.params_of(cpshard.parallelize(model, mesh)), batch, mesh).loss.item()
    return plain, parallel


def test_a_parallelized_model_runs_once_its_layout_is_probed(ranks4):
    for plain, parallel in ranks4.run(parallelized_after_the_probe):
        assert abs(plain - parallel) <= 1e-5 * abs(plain), (plain, parallel)


def probed_in_training_mode():
    """A model in training mode with dropout (BERT's default 0.1) passes the probe, which runs with dropout
    off: two dropout masks never agree, cp or not. Each module's mode is its own again afterwards."""
    model = tiny_model("bert", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1).train()
    model.bert.embeddings.eval()  # a module in its own mode stays in it
    forward = cpshard.make_cp_forward(model)
    out = forward(
        cpshard.params_of(model), tiny_batch(model.config.vocab_size, 2, 9), cpshard.make_mesh(cp=2)
    )
    modes = {name: module.training for name, module in model.named_modules()}
    return bool(torch.isfinite(out.loss)), modes["bert.encoder"], modes["bert.embeddings"]


def test_the_probe_runs_without_dropout_and_gives_the_modes_back(ranks2):
    assert ranks2.run(probed_in_training_mode) == [(True, True, False)] * 2


def model_runs_in_first_call(version: str | None) -> int:
    """How many times the first layer runs in a registered layout's first cp call, with the installed
    transformers reporting ``version`` (None: as installed)."""
    installed = transformers.__version__
    transformers.__version__ = version or installed
    try:
        model = tiny_model("llama")
        runs = []
        model.model.layers[0].register_forward_hook(lambda *_: runs.append(1))
        forward = cpshard.make_cp_forward(model)
        cpshard.value_and_grad(forward)(
            cpshard.params_of(model), tiny_batch(128, 2, 9), cpshard.make_mesh(cp=2)
        )
        return len(runs)
    finally:
        transformers.__version__ = installed


def test_a_registered_layout_is_probed_on_a_transformers_it_was_not_tested_on(ranks2):
    """Its model's code may have changed under it: the probe runs the model besides the call."""
    tested, untested = (
        ranks2.run(model_runs_in_first_call, None),
        ranks2.run(model_runs_in_first_call, "9.0.0"),
    )
    assert tested == [1, 1] and all(runs > 1 for runs in untested), (tested, untested)


def probe_of_a_cp_run_that_drops_the_padding_mask(dtype=torch.float32, hook=None) -> str:
    """The probe's message for a cp run that loses the batch's padding mask (what a wrong mask path does):
    an unpadded probe would pass it; the probe's left-padded row does not. ``hook``: a pre-hook on the
    first layer."""
    model = tiny_model("llama", attn_implementation="auto", dtype=dtype)
    if hook is not None:
        model.get_submodule("model.layers.0").register_forward_pre_hook(hook)
    forward = cpshard.make_cp_forward(model, layout=DECODER.with_rows(name="renamed"))
    run = type(forward).__call__
    dropping = type("Dropping", (type(forward),), {})
    dropping.__call__ = lambda self, params, batch, mesh: run(
        self, params, {k: v for k, v in batch.items() if k != "attention_mask"}, mesh
    )
    forward.__class__ = dropping
    return probe_message(model, forward)


def test_the_probe_has_a_padded_row(ranks2):
    messages = ranks2.run(probe_of_a_cp_run_that_drops_the_padding_mask)
    assert all("differs between cp and one process" in message for message in messages), messages
    # rank 1 holds the real positions after the padding: its first layer's output differs there
    assert "on a probe batch, the output of model.layers.0 differs" in messages[1], messages


def test_a_half_models_second_look_keeps_a_cp_error(ranks2):
    """In bf16 a row beyond the tolerance is looked at again against one process in fp32; a cp error keeps
    its size there, and the message says both distances."""
    messages = ranks2.run(probe_of_a_cp_run_that_drops_the_padding_mask, torch.bfloat16)
    assert all("differs between cp and one process" in message for message in messages), messages
    said = re.search(
        r"cp lies (\S+) of scale from one process in fp32, one process in bfloat16 (\S+)\)", messages[1]
    )
    assert said and float(said[1]) > 10 * float(said[2]), messages


def autocast_probe_of_a_cp_run_that_drops_the_padding_mask() -> str:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return probe_of_a_cp_run_that_drops_the_padding_mask()


def test_under_autocast_the_second_look_keeps_a_cp_error(ranks2):
    """Under autocast (fp32 weights) the probe holds rows to the half types' tolerance and looks again
    against one process in float64, which autocast does not cast: a cp error keeps its size there."""
    messages = ranks2.run(autocast_probe_of_a_cp_run_that_drops_the_padding_mask)
    assert all("differs between cp and one process" in message for message in messages), messages
    said = re.search(
        r"cp lies (\S+) of scale from one process in float64, one process in bfloat16 (\S+)\)", messages[1]
    )
    assert said and float(said[1]) > 10 * float(said[2]), messages


def failing_in_fp32(module, args):
    if args[0].dtype == torch.float32:
        raise RuntimeError("expected m1 and m2 to have the same dtype")


def test_a_half_models_second_look_that_raises_leaves_the_verdict_and_says_so(ranks2):
    messages = ranks2.run(probe_of_a_cp_run_that_drops_the_padding_mask, torch.bfloat16, failing_in_fp32)
    assert all("differs between cp and one process" in message for message in messages), messages
    said = (
        "(a second look against one process in fp32 raised RuntimeError: expected m1 and m2 to have the same"
    )
    assert said in messages[1], messages


def bf16_probe_of(model_type: str, tokens: int) -> float:
    """A bf16 model's first cp call (the probe of its derived layout), then its loss against one process's."""
    model = tiny_model(model_type, dtype=torch.bfloat16)
    batch, mesh = tiny_batch(model.config.vocab_size, 2, tokens), cpshard.make_mesh(cp=4)
    loss = cpshard.make_cp_forward(model)(cpshard.params_of(model), batch, mesh).loss
    with torch.no_grad():
        return ((loss - model(**batch, use_cache=False).loss).abs() / loss.abs()).item()


@pytest.mark.parametrize(
    "model_type, tokens", [("mbart", 130), ("bart", 130), ("rwkv", 130), ("minimax", 130), ("xlstm", 37)]
)
def test_a_bf16_model_s_derived_layout_passes_its_probe_at_cp4(ranks4, model_type, tokens):
    """BART's causal LMs in bf16: their loss was read as one of shifted labels (test_derive), cp shifted the
    labels again, and the probe refused the layout. RWKV's and MiniMax's: bf16's rounding through the WKV
    scan and the lightning attention went past the half types' tolerance (on one rank of four, MiniMax's: the
    second look runs there alone, without a hang), where cp lies as near one process in fp32 as one process
    in bf16 does. xLSTM's bf16 model gives fp32 logits, which the probe held to fp32's tolerance: a row is
    held to its weights' type's. Now each passes, and the loss is one process's to bf16's tolerance."""
    for difference in ranks4.run(bf16_probe_of, model_type, tokens):
        assert difference < 5e-2


def first_call_without_gradients(mode: str) -> float:
    """A derived layout's first call (its probe's) under ``torch.no_grad`` or ``torch.inference_mode``: the
    largest distance of its logits from one process's."""
    model = tiny_model("gpt2").eval()
    forward, mesh = cpshard.make_cp_forward(model), cpshard.make_mesh(cp=2)
    batch = {"input_ids": tiny_batch(model.config.vocab_size, 2, 16)["input_ids"]}
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        logits = forward(cpshard.params_of(model), batch, mesh).logits.full_tensor()
    return (logits - model(**batch).logits).abs().max().item()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_an_inference_first_call_is_probed_with_gradients(ranks2, mode):
    # the probe compares gradients: under the caller's no_grad its backward raised, blamed on the model
    assert max(ranks2.run(first_call_without_gradients, mode)) < 1e-5


def another_types_file_or_an_edit(case: str) -> str:
    """The first call of a layout that is not the model's own tested file: another type's registered file,
    or the model's layout edited after a call that probed it (the same name). What it raised, else 'ran'."""
    from dataclasses import replace

    from cpshard.layouts.registry import resolve_layout

    mesh = cpshard.make_mesh(cp=2)
    if case == "edited":
        model = tiny_model("qwen2")
        batch = tiny_batch(model.config.vocab_size, 2, 16)
        cpshard.value_and_grad(cpshard.make_cp_forward(model))(cpshard.params_of(model), batch, mesh)
        forward = cpshard.make_cp_forward(model, layout=replace(resolve_layout(model), labels_shifted=True))
    else:  # gpt_oss's attention sinks, which llama's file does not name; mistral's layers, which it fits
        model = tiny_model("gpt_oss" if case == "unfit" else "mistral")
        batch = tiny_batch(model.config.vocab_size, 2, 16)
        forward = cpshard.make_cp_forward(model, layout="llama", implementation="ring")
    try:
        cpshard.value_and_grad(forward)(cpshard.params_of(model), batch, mesh)
    except cpshard.LayoutError as error:
        return str(error)
    return "ran"


@pytest.mark.parametrize(
    "case, says",
    [
        # both trusted untested before: the ring on gpt_oss gave wrong gradients, the edit a wrong loss
        ("unfit", "cpshard cannot vouch for layout 'llama' on GptOssForCausalLM"),
        ("edited", "cpshard cannot vouch for layout 'derived:qwen2' on Qwen2ForCausalLM"),
        ("fit", "ran"),
    ],
)
def test_another_types_file_and_an_edited_layout_are_probed(ranks2, case, says):
    for message in ranks2.run(another_types_file_or_an_edit, case):
        assert message.startswith(says), message


def without_the_halo() -> str:
    """Qwen3-Next's layout with its recurrent row's convolution dropped (no halo): only the second rank's
    slice needs one, so only its layers differ; the first rank's logits differ through the attention."""
    from dataclasses import replace

    from cpshard.layouts.qwen3_next import LAYOUT

    model = tiny_model("qwen3_next")
    layout = replace(LAYOUT, recurrent=(replace(LAYOUT.recurrent[0], conv=None),))
    forward = cpshard.make_cp_forward(model, layout=layout)
    batch = tiny_batch(model.config.vocab_size, 2, 24)
    try:
        cpshard.value_and_grad(forward)(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))
    except cpshard.LayoutError as error:
        return str(error)
    return "ran"


def test_every_rank_names_the_earliest_difference_of_any_rank(ranks2):
    # the first rank named the logits ("every layer agrees: look at the final norm and the LM head")
    first, second = ranks2.run(without_the_halo)
    assert first == second
    assert "on a probe batch, the output of model.layers.0 differs between cp and one process" in first


def an_edit_that_fails_in_the_cp_run() -> str:
    """Llama's layout without its rotary pair among the layer inputs: each rank's layers get the whole pair
    and the model's rotary product raises in the probe's cp run."""
    from dataclasses import replace

    from cpshard.layouts.llama import LAYOUT

    model = tiny_model("llama")
    layout = replace(LAYOUT, layer_inputs=LAYOUT.layer_inputs[1:])
    forward = cpshard.make_cp_forward(model, layout=layout)
    batch = tiny_batch(model.config.vocab_size, 2, 16)
    try:
        forward(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))
    except cpshard.LayoutError as error:
        return str(error)
    return "ran"


def test_a_given_layout_that_fails_is_blamed_not_the_transformers_release(ranks2):
    for message in ranks2.run(an_edit_that_fails_in_the_cp_run):
        assert "as the layout given describes it (installed transformers" in message, message
        assert "check its rows against the model (`cpshard layout MODEL` prints" in message, message
        assert "constraints.txt" not in message


def test_a_copy_of_the_registered_file_is_trusted_as_the_file():
    """``cpshard layout``'s printed file, saved and loaded, is the registered table row for row: trusted on
    its own type untested as the file is (under tp a layout cpshard must probe is refused on parallel
    parameters, with a message that said "tested on 5.25.0 (tested: 5.25.0)" for it); an edit is not."""
    from cpshard.runtime.probe import _own_file, _untested
    from cpshard.tools.layout_file import layout_for

    model, namespace = tiny_model("qwen3"), {}
    exec(layout_for("qwen3"), namespace)  # noqa: S102 -- the file a user saves and imports
    printed = namespace["LAYOUT"]
    assert _own_file(printed, model)  # trusted untested on the release its tests passed on
    edited = printed.with_rows(labels_shifted=True)
    assert not _own_file(edited, model)
    assert "it is not the registered file of model type 'qwen3' (an edit" in _untested(edited, model)
