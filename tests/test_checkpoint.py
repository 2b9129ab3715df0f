"""Checkpoints: saved under one mesh, loaded bit for bit under another and on one process; from_pretrained."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import cpshard
from cpshard.runtime.optim import adamw_init, adamw_update
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
    cpshard.save_checkpoint(params, path)
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
    ],
    ids=["tp2xcp2-to-fsdp2xcp2", "moe-ep4-to-hsdp-ep2"],
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


def test_load_names_what_does_not_fit(saved):
    path, _, values = saved
    with pytest.raises(KeyError, match="has no model.extra"):
        cpshard.load_checkpoint(path, {"model.extra": torch.zeros(2)})
    wrong_dtype = r"holds model.norm.weight as torch.float32 \[64\], the target is torch.bfloat16 \[64\]"
    with pytest.raises(ValueError, match=wrong_dtype):
        cpshard.load_checkpoint(path, {"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)})
