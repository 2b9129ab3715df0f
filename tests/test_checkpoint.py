"""Checkpoints: saved under one mesh, loaded bit for bit under another and on one process; from_pretrained."""

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import cpshard
from cpshard.optim import adamw_init, adamw_update
from cpshard.tools.tiny import tiny_batch, tiny_model

VOCAB = 130  # uneven shards over 4 ranks


def _whole(params: dict) -> dict:
    return {
        name: value.full_tensor() if isinstance(value, DTensor) else value.detach()
        for name, value in params.items()
    }


def run_save(path: str, folder: str, sizes: dict, model_type: str = "llama"):
    """One AdamW step under ``sizes`` (values no fresh model has), then both kinds of save."""
    mesh = cpshard.make_mesh(**sizes)
    model = tiny_model(model_type, vocab_size=VOCAB)
    params = cpshard.params_of(cpshard.parallelize(model, mesh))
    batch = tiny_batch(VOCAB, 2, 9, seed=mesh.get_local_rank("fsdp") + 1)
    _, grads = cpshard.value_and_grad(cpshard.make_cp_forward(model))(params, batch, mesh)
    params, _ = adamw_update(params, grads, adamw_init(params), lr=1e-2)
    cpshard.save_checkpoint(params, path, model=model)
    cpshard.save_pretrained(model, params, folder)
    return _whole(params)


def run_load(path: str, sizes: dict, parallel: bool, model_type: str = "llama"):
    """Load into a model of other weights under ``sizes``: like the targets in all but values."""
    mesh = cpshard.make_mesh(**sizes)
    model = tiny_model(model_type, vocab_size=VOCAB, seed=5)
    targets = cpshard.params_of(cpshard.parallelize(model, mesh) if parallel else model)
    before = _whole(targets)
    loaded = cpshard.load_checkpoint(path, targets)
    alike = all(
        isinstance(loaded[n], DTensor) == isinstance(t, DTensor)
        and (loaded[n].shape, loaded[n].dtype) == (t.shape, t.dtype)
        and (
            not isinstance(t, DTensor)
            or (loaded[n].device_mesh, loaded[n].placements) == (t.device_mesh, t.placements)
        )
        for n, t in targets.items()
    )
    untouched = all(torch.equal(before[n], value) for n, value in _whole(targets).items())
    return list(loaded) == list(targets) and alike and untouched, _whole(loaded)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)  # fp32 throughout: NaN-safe, signed zeros told apart


def _bitwise(a: dict, b: dict) -> bool:
    """Same keys, dtypes and values to the last bit."""
    return list(a) == list(b) and all(
        a[n].dtype == b[n].dtype and torch.equal(_bits(a[n]), _bits(b[n])) for n in a
    )


@pytest.fixture(scope="module")
def saved(ranks4, tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint")
    path, folder = str(root / "dcp"), str(root / "pretrained")
    values = ranks4.run(run_save, path, folder, dict(fsdp=2, cp=2))
    assert all(_bitwise(values[0], v) for v in values[1:])
    return path, folder, values[0]


@pytest.mark.parametrize(
    "sizes, parallel",
    [(dict(cp=4), False), (dict(dp_replicate=2, cp=2), True), (dict(tp=2, cp=2), True)],
    ids=["cp4-plain", "hsdp2xcp2", "tp2xcp2"],
)
def test_load_under_another_mesh_is_bitwise(ranks4, saved, sizes, parallel):
    path, _, values = saved
    for alike, loaded in ranks4.run(run_load, path, sizes, parallel):
        assert alike and _bitwise(loaded, values)


def test_load_and_save_on_one_process_without_a_process_group(ranks4, saved, tmp_path):
    path, _, values = saved
    assert not dist.is_initialized()
    targets = cpshard.params_of(tiny_model("llama", vocab_size=VOCAB, seed=5))
    loaded = cpshard.load_checkpoint(path, targets)
    assert _bitwise(loaded, values) and all(type(v) is torch.Tensor for v in loaded.values())
    cpshard.save_checkpoint(loaded, tmp_path / "single")
    for alike, again in ranks4.run(run_load, str(tmp_path / "single"), dict(fsdp=2, cp=2), True):
        assert alike and _bitwise(again, values)


def test_save_pretrained_folder_loads_with_from_pretrained(saved):
    _, folder, values = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    batch = tiny_batch(VOCAB, 2, 11, pad="right")
    reference = torch.func.functional_call(tiny_model("llama", vocab_size=VOCAB, seed=5), values, (), batch)
    assert _bitwise(cpshard.params_of(loaded), values)
    assert torch.equal(loaded(**batch).logits, reference.logits)


@pytest.mark.parametrize(
    "model_type, saved_under, loaded_under",
    [
        ("llama", dict(tp=2, cp=2), dict(fsdp=2, cp=2)),
        ("qwen3_moe", dict(fsdp=2, cp=2, ep=4), dict(dp_replicate=2, cp=2, ep=2)),
        ("qwen3_moe", dict(cp=2, tp=2, ep=4), dict(cp=2, tp=2, ep=2)),
        ("qwen3_moe", dict(cp=2, tp=2, ep=2), dict(fsdp=2, cp=2, ep=4)),
    ],
    ids=["tp2xcp2-to-fsdp2xcp2", "moe-ep4-to-hsdp-ep2", "moe-tp2-ep4-to-tp2-ep2", "moe-tp2-ep2-to-fsdp2-ep4"],
)
def test_tp_and_ep_saves_load_anywhere_and_with_from_pretrained(
    ranks4, tmp_path, model_type, saved_under, loaded_under
):
    path, folder = str(tmp_path / "dcp"), str(tmp_path / "pretrained")
    values = ranks4.run(run_save, path, folder, saved_under, model_type)[0]
    loaded = cpshard.load_checkpoint(
        path, cpshard.params_of(tiny_model(model_type, vocab_size=VOCAB, seed=5))
    )
    assert _bitwise(loaded, values)
    assert _bitwise(cpshard.params_of(AutoModelForCausalLM.from_pretrained(folder)), values)
    for alike, again in ranks4.run(run_load, path, loaded_under, True, model_type):
        assert alike and _bitwise(again, values)


def test_a_model_in_place_of_its_params_is_a_type_error(saved, tmp_path):
    """A model, or its named_parameters(), where a params dict goes: before, an AttributeError or a TypeError
    from deep inside ("'LlamaForCausalLM' object has no attribute 'items'")."""
    path, model = saved[0], tiny_model("llama")
    for call, taker, given in [
        (
            lambda: cpshard.save_checkpoint(model, tmp_path / "not-written"),
            "save_checkpoint",
            "LlamaForCausalLM",
        ),
        (lambda: cpshard.load_checkpoint(path, model), "load_checkpoint", "LlamaForCausalLM"),
        (lambda: cpshard.load_checkpoint(path, model.named_parameters()), "load_checkpoint", "generator"),
    ]:
        with pytest.raises(TypeError, match=f"{taker}: params must be a dict .* got {given}"):
            call()
    assert not (tmp_path / "not-written").exists()


def test_load_names_what_does_not_fit(saved):
    path, _, values = saved
    with pytest.raises(cpshard.CheckpointError, match=f"no model.extra; it holds {len(values)} tensors the"):
        cpshard.load_checkpoint(path, {"model.extra": torch.zeros(2)})
    wrong_dtype = r"holds model.norm.weight as torch.float32 \[64\], the target is torch.bfloat16 \[64\]"
    with pytest.raises(cpshard.CheckpointError, match=wrong_dtype):
        cpshard.load_checkpoint(
            path, {"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}, strict=False
        )
    with pytest.raises(cpshard.CheckpointError, match="pass strict=False to load a part of it"):
        cpshard.load_checkpoint(path, {"model.norm.weight": values["model.norm.weight"]})
    part = cpshard.load_checkpoint(path, {"model.norm.weight": torch.zeros(64)}, strict=False)
    assert _bitwise(part, {"model.norm.weight": values["model.norm.weight"]})


def run_load_error(path: str, model_type: str = "llama", with_model: bool = True) -> str | None:
    """What loading ``path`` into a fresh model under fsdp=2 x cp=2 raises on this rank (None: it loaded)."""
    model = tiny_model(model_type, vocab_size=VOCAB, seed=5)
    targets = cpshard.params_of(cpshard.parallelize(model, cpshard.make_mesh(fsdp=2, cp=2)))
    try:
        cpshard.load_checkpoint(path, targets, model=model if with_model else None)
    except cpshard.CheckpointError as error:
        return str(error)
    return None


def _flip_a_byte(folder: Path):
    shard = folder / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _truncate(folder: Path):
    shard = folder / "__2_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])


DAMAGE = {
    "a flipped byte": (_flip_a_byte, "file __1_0.distcp is damaged: its sha256 differs from the one saved"),
    "a deleted shard": (lambda folder: (folder / "__3_0.distcp").unlink(), "file __3_0.distcp is missing"),
    "a truncated shard": (_truncate, "file __2_0.distcp is truncated"),
    "no metadata": (lambda folder: (folder / ".metadata").unlink(), "file .metadata is missing"),
    "no manifest": (
        lambda folder: (folder / "cpshard.json").unlink(),
        "has no cpshard.json: it was not written by cpshard.save_checkpoint, or its save did not finish",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_on_every_rank(ranks4, saved, tmp_path, damage):
    path, _, _ = saved
    harm, expected = DAMAGE[damage]
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    harm(copy)
    messages = ranks4.run(run_load_error, str(copy))
    assert len(set(messages)) == 1 and expected in messages[0], messages[0]
    with pytest.raises(cpshard.CheckpointError) as alone:  # one process, no process group
        cpshard.load_checkpoint(copy, cpshard.params_of(tiny_model("llama", vocab_size=VOCAB)))
    assert str(alone.value) == messages[0]
    if damage != "no metadata":
        assert "(it holds " in messages[0] or "no cpshard.json" in messages[0]  # which tensors it hurts


def test_another_architectures_checkpoint_is_refused_on_every_rank(ranks4, saved, tmp_path):
    path, _, _ = saved
    for message in ranks4.run(run_load_error, path, "qwen3"):
        assert "was saved from a llama model (LlamaForCausalLM), the target is a qwen3 model" in message
    for message in ranks4.run(run_load_error, path, "qwen3", False):  # the names tell it without the model
        assert "saved from a llama model (LlamaForCausalLM), does not fit the target: it has no " in message
        assert "q_norm" in message


def _die_part_way(path: str):
    """Rank 1 dies as soon as a shard of the save is on disk (a crash between files)."""
    mesh = cpshard.make_mesh(cp=2)
    partial = Path(path + ".partial")
    if dist.get_rank() == 1:

        def watch():
            while not any(partial.glob("*.distcp")):
                time.sleep(0.001)
            os._exit(7)

        threading.Thread(target=watch, daemon=True).start()
    params = {"big": torch.zeros(1 << 24), **cpshard.params_of(tiny_model("llama", vocab_size=VOCAB))}
    cpshard.save_checkpoint(params, path)
    return mesh.size()


@pytest.mark.ranks
def test_a_save_cut_short_leaves_no_checkpoint(tmp_path):
    path = str(tmp_path / "dcp")
    with pytest.raises(cpshard.RankError, match="rank 1 exited with code 7"):
        cpshard.launch(_die_part_way, path, nprocs=2, timeout=300)
    with pytest.raises(cpshard.CheckpointError, match="a save that did not finish left .*dcp.partial"):
        cpshard.load_checkpoint(path, cpshard.params_of(tiny_model("llama", vocab_size=VOCAB)))
    model = tiny_model("llama", vocab_size=VOCAB)
    cpshard.save_checkpoint(cpshard.params_of(model), path, model=model)  # over what was left
    assert not Path(path + ".partial").exists()
    loaded = cpshard.load_checkpoint(path, cpshard.params_of(tiny_model("llama", vocab_size=VOCAB, seed=5)))
    assert _bitwise(loaded, _whole(cpshard.params_of(model)))


def test_whole_weights_go_back_into_a_plain_model_and_name_what_lacks(tmp_path):
    """``load_whole_weights`` (CPTrainer's resume of a parallelized model: each DTensor cuts its shard, as
    tests/test_integrations_transformers.py checks at fsdp2 x cp2) on plain parameters: tied ones once."""
    from cpshard.parallel.checkpoint import CheckpointError, load_whole_weights

    saved = tiny_model("gemma3", vocab_size=64, seed=1)  # tied embeddings
    saved.save_pretrained(tmp_path / "saved")
    model = tiny_model("gemma3", vocab_size=64, seed=2)
    load_whole_weights(model, tmp_path / "saved")
    assert all(torch.equal(p, dict(saved.named_parameters())[n]) for n, p in model.named_parameters())
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_whole_weights(model, tmp_path)


def test_whole_weights_a_folder_lacks_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from cpshard.parallel.checkpoint import CheckpointError, load_whole_weights

    model = tiny_model("llama", vocab_size=64)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks the weights of model.norm.weight"):
        load_whole_weights(model, tmp_path)
