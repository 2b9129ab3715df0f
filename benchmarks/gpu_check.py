"""What one accelerator can show of cpshard, checked in one run (sized for under 5 minutes on one H200):

- the ring's block: the ring's own block function (:func:`cpshard.attention.ring.tiled_attention`, the tiles
  of cp=2's head-tail order) over the two halves of the keys, merged by log-sum-exp, against one flash
  ``scaled_dot_product_attention`` call over all keys: the same output, and the time ratio (target 1.10).
  ``ring.py`` runs torch's fused flash kernel on the CPU only; on CUDA a block is explicit softmax math in
  fp32 (scores materialized), and this check times that, as the ring runs it;
- a compiled decoder layer: a small Llama at cp=1, ``make_cp_forward(compile=True)`` (inductor) against the
  same step eager: loss and gradients equal within the dtype's tolerance, the first compiled call and the
  steady-state ratio;
- bf16 parity: one cp=1 step of ``value_and_grad(make_cp_forward(model))`` against the plain model's
  ``loss.backward()`` on the same weights and batch: the largest relative difference of loss and gradients;
- cp=2 on the device: two local ranks sharing it (over gloo), one fp32 Ulysses step on a left-padded batch
  against the plain model's, and greedy tokens of ``cpshard.generate`` against ``model.generate``: what
  cpshard builds for a step and a prefill (positions, masks, counts, its checks' rows) meets the model's
  tensors there;
- the recurrent kernels: fla's ``chunk_gated_delta_rule`` (when fla imports) against transformers' torch
  reference, as the model calls it (in the dtype) and as cpshard's state passing calls it
  (:func:`cpshard.recurrent.affine.delta_rule_summary`: fp32, the values widened by the identity).

Each row: the check, what it measured (a relative difference ``max|x - ref| / max|ref|``, a time ratio, or
seconds), its target, and PASS, FAIL, SKIP or INFO (a measurement without a target); the exit status is 1
when any row fails. Times are CUDA events on CUDA (the wall clock on the CPU), medians of rounds that
alternate the timed variants after warm-up; the machine's load prints beside them.

    python benchmarks/gpu_check.py                          # CUDA, bf16, the full sizes
    python benchmarks/gpu_check.py --device cpu --quick     # CPU, fp32, tiny sizes: the numbers in seconds
    python benchmarks/gpu_check.py --device cpu --quick --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

import cpshard
from cpshard.attention.blocks import allowed, tiles
from cpshard.attention.ring import NEG_INF, Block, Scoring, _fused, grouped, tiled_attention
from cpshard.debug.table import table
from cpshard.recurrent.affine import delta_rule_summary
from cpshard.spec.sequence import chunk_width
from cpshard.tools.tiny import tiny_batch, tiny_model

#: cpshard's floor is torch 2.13, but a GPU machine's image may hold an older torch, too large to replace:
#: older releases (2.11 among them) name the single-tensor gather and reduce-scatter otherwise, and nothing
#: else this check runs differs there (every row passes on the CPU with torch 2.11.0; the test suite does
#: not, so the floor stays). Set at import, so the spawned ranks set it too.
OLDER_TORCH = not hasattr(dist, "all_gather_single")
if OLDER_TORCH:
    dist.all_gather_single = dist.all_gather_into_tensor
    dist.reduce_scatter_single = dist.reduce_scatter_tensor

#: the largest relative difference a result may have from its reference. bf16 keeps 8 significant bits: one
#: rounding moves a value by up to 2**-9 of itself, and two computations of the same number in a different
#: order (or with intermediates kept in fp32 by one and rounded by the other) differ by a few such steps;
#: measured against the largest value of the tensor, 2e-2 is about five bf16 steps of the largest value
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
#: cpshard's slice summary calls the kernel in fp32; triton's dots take fp32 as TF32 (10 significant bits)
TF32_TOLERANCE = 5e-3


class Sizes(NamedTuple):
    attention: tuple[int, int, int, int, int]  # B, q heads, kv heads, L, head dim
    model: dict  # tiny_model("llama", ...) overrides
    length: int  # the training steps' L (B=1)
    delta_rule: tuple[int, int, int, int, int]  # B, L, k heads, v heads, head dim (k and v alike)
    repeats: int
    ring_target: float | None  # the ring block's time over one flash call's (tiny sizes time overheads)


SIZES = {
    "full": Sizes(
        (1, 32, 8, 8192, 128),
        dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=32000,
            initializer_range=0.02,
        ),
        4096,
        (1, 4096, 8, 16, 128),
        10,
        1.10,
    ),
    "quick": Sizes((1, 4, 2, 256, 16), {}, 64, (1, 96, 2, 4, 16), 3, None),
}


class Row(NamedTuple):
    name: str
    value: float | None  # None: nothing measured
    target: float | None  # PASS at or below it; None: a measurement without a target
    note: str = ""
    outcome: str | None = None  # where nothing was measured: SKIP or FAIL

    @property
    def verdict(self) -> str:
        if self.outcome is not None:
            return self.outcome
        if self.target is None:
            return "INFO"
        return "PASS" if self.value <= self.target else "FAIL"


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``max|value - reference| / max|reference|``, in fp32."""
    value, reference = value.float(), reference.float()
    return ((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def worst_grad(grads: dict, reference: dict) -> tuple[float, str]:
    """The largest relative difference over the gradients, and the parameter it is in."""
    return max((relative(grads[name], ref), name) for name, ref in reference.items())


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f} (1, 5, 15 min)".format(*os.getloadavg())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_ms(fn, device: torch.device) -> float:
    """One call of ``fn``: CUDA events on CUDA (the stream's time from launch to end), else the wall clock."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


def medians_ms(fns: dict, device: torch.device, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median ms of each of ``fns``, the calls alternating round by round so that noise slows all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(elapsed_ms(fn, device))
    return {name: statistics.median(values) for name, values in times.items()}


# ----------------------------------------------------------------------------- the ring's block


def ring_halves(q, k, v, masks: list, block_tiles: list) -> torch.Tensor:
    """q over each half of the keys in turn, merged by log-sum-exp, as :func:`ring_forward` merges the blocks
    that reach a rank (its communication aside): the output in q's shape and dtype."""
    qg = grouped(q.float(), k.shape[1])
    out = torch.zeros_like(qg)
    lse = torch.full(qg.shape[:-1], NEG_INF, dtype=torch.float32, device=q.device)
    half = k.shape[2] // 2
    for index, (mask, needed) in enumerate(zip(masks, block_tiles)):
        keys = slice(index * half, (index + 1) * half)
        block = Block(qg, k[:, :, keys], v[:, :, keys], mask, Scoring(q.shape[-1] ** -0.5))
        tiled_attention(out, lse, block, needed)
    return out.reshape(q.shape).to(q.dtype)


def ring_block(device: torch.device, dtype: torch.dtype, sizes: Sizes) -> list[Row]:
    """The ring's block math over two key halves against one flash call over all keys: output and time."""
    batch, heads, kv_heads, length, dim = sizes.attention
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, h, length, dim, generator=generator).to(device, dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    positions = torch.arange(length, device=device)
    halves = positions.split(length // 2)
    masks = [allowed(None, positions, keys) for keys in halves]
    tile = chunk_width("head_tail", length, 2)
    block_tiles = [tiles(mask, tile) for mask in masks]
    k_all, v_all = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True)

    def ring():
        return ring_halves(q, k, v, masks, block_tiles)

    difference = relative(ring(), flash())
    ms = medians_ms({"ring": ring, "flash": flash}, device, sizes.repeats)
    fused = _fused(Block(q, k, v, masks[0], Scoring(1.0)))
    path = f"{'fused flash kernel' if fused else 'fp32 softmax math'}, {sum(map(len, block_tiles))} tiles"
    shape = f"B={batch}, {heads}/{kv_heads} heads, L={length}, D={dim}"
    return [
        Row("ring block: output vs one flash call", difference, TOLERANCE[dtype], shape),
        Row(
            "ring block: time / one flash call",
            ms["ring"] / ms["flash"],
            sizes.ring_target,
            f"ring {ms['ring']:.2f} ms ({path}), flash {ms['flash']:.2f} ms",
        ),
    ]


# ----------------------------------------------------------------------------- cp=1 steps


@contextmanager
def one_process(device: torch.device):
    """A process group of this process alone and its cp=1 mesh, ended on leaving."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield cpshard.make_mesh(cp=1, device_type=device.type)
    finally:
        dist.destroy_process_group()


def llama(device: torch.device, dtype: torch.dtype, sizes: Sizes) -> tuple:
    """A small random transformers LlamaForCausalLM on ``device`` and a batch of one row for it."""
    model = tiny_model("llama", dtype=dtype, **sizes.model).to(device)
    batch = tiny_batch(model.config.vocab_size, 1, sizes.length)
    return model, {key: value.to(device) for key, value in batch.items()}


def stepper(model, mesh, **options):
    """``batch -> (loss, gradients)``: one cpshard step of ``model``, prepared once (``options``: those of
    :func:`cpshard.make_cp_forward`)."""
    grads_of, params = (
        cpshard.value_and_grad(cpshard.make_cp_forward(model, **options)),
        cpshard.params_of(model),
    )

    def run(batch: dict) -> tuple[torch.Tensor, dict]:
        out, grads = grads_of(params, batch, mesh)
        return out.loss, grads

    return run


def agreement(name: str, result: tuple, reference: tuple, exact: tuple | None, dtype) -> list[Row]:
    """Rows for ``result``'s loss and worst gradient against ``reference``'s. The target is the dtype's
    tolerance or, where larger, twice ``reference``'s own distance from ``exact`` (the same step on fp32
    copies of the weights; None in fp32): a result as accurate as the reference is at most that far from it.
    """
    (loss, grads), (ref_loss, ref_grads) = result, reference
    loss_target = grads_target = TOLERANCE[dtype]
    if exact is not None:
        loss_target = max(loss_target, 2 * relative(ref_loss, exact[0]))
        grads_target = max(grads_target, 2 * worst_grad(ref_grads, exact[1])[0])
    worst, parameter = worst_grad(grads, ref_grads)
    return [
        Row(f"{name}: loss", relative(loss, ref_loss), loss_target),
        Row(f"{name}: gradients", worst, grads_target, f"worst: {parameter}"),
    ]


def fp32_copy(model, dtype):
    """An fp32 copy of ``model`` (the same weights), or None when ``model`` is fp32 already."""
    return None if dtype == torch.float32 else copy.deepcopy(model).float()


def compiled_layers(device, dtype, sizes: Sizes, mesh, compile=True) -> list[Row]:
    """``make_cp_forward(compile=compile)`` (True: inductor) against the same step eager, at cp=1."""
    torch._dynamo.reset()
    eager, batch = llama(device, dtype, sizes)
    compiled, exact = copy.deepcopy(eager), fp32_copy(eager, dtype)  # compiling changes layers in place
    steps = {"eager": stepper(eager, mesh), "compiled": stepper(compiled, mesh, compile=compile)}
    synchronize(device)
    start = time.perf_counter()
    result = steps["compiled"](batch)
    synchronize(device)
    first = time.perf_counter() - start
    reference = steps["eager"](batch)
    ms = medians_ms({key: partial(run, batch) for key, run in steps.items()}, device, sizes.repeats)
    exact = None if exact is None else stepper(exact, mesh)(batch)
    return agreement("compiled layers vs eager", result, reference, exact, dtype) + [
        Row("compiled layers: first call, s", first, None, "tracing and code generation included"),
        Row(
            "compiled layers: step time / eager",
            ms["compiled"] / ms["eager"],
            None,
            f"compiled {ms['compiled']:.1f} ms, eager {ms['eager']:.1f} ms, L={sizes.length}",
        ),
    ]


def cp1_parity(device, dtype, sizes: Sizes, mesh) -> list[Row]:
    """One cp=1 step of cpshard against the plain model's ``loss.backward()``, same weights and batch."""
    model, batch = llama(device, dtype, sizes)
    exact = fp32_copy(model, dtype)
    loss = model(**batch).loss
    loss.backward()
    plain = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    result = stepper(model, mesh)(batch)
    exact = None if exact is None else stepper(exact, mesh)(batch)
    label = str(dtype).removeprefix("torch.")
    return agreement(f"cp=1 {label} step vs plain model", result, (loss, plain), exact, dtype)


def autocast_parity(device, sizes: Sizes, mesh) -> list[Row]:
    """One cp=1 step of an fp32 model under bf16 autocast (what Trainer's bf16=True runs on a GPU) against the
    plain model's under the same autocast, the target from the same step without autocast. On a GPU the
    backward runs in autograd's own threads: cpshard's pieces compute with autocast off there as here."""
    model, batch = llama(device, torch.float32, sizes)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(**batch).loss
        loss.backward()
    plain = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    step = stepper(model, mesh)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        result = step(batch)
    exact = step(batch)
    return agreement("cp=1 step under bf16 autocast", result, (loss, plain), exact, torch.bfloat16)


def cp1_steps(device, dtype, sizes: Sizes) -> list[Row]:
    """The compiled-layers and parity checks, in a process group of this process alone."""
    with one_process(device) as mesh:
        return (
            guarded("compiled layers", compiled_layers, device, dtype, sizes, mesh)
            + guarded("cp=1 parity", cp1_parity, device, dtype, sizes, mesh)
            + guarded("autocast parity", autocast_parity, device, sizes, mesh)
        )


# ----------------------------------------------------------------------------- cp=2 on one device


#: the tokens cp=2's check generates per row (prefill, then decode steps over the sharded cache)
GENERATED = 8


def left_padded_llama(device: torch.device, sizes: Sizes) -> tuple:
    """The fp32 small Llama on ``device`` and a left-padded batch of two rows for it (the masks run too)."""
    model = tiny_model("llama", **sizes.model).to(device)
    batch = tiny_batch(model.config.vocab_size, 2, sizes.length, pad="left")
    return model, {key: value.to(device) for key, value in batch.items()}


def cp2_rank(device_type: str, sizes: Sizes) -> tuple[float, dict, torch.Tensor]:
    """On each of two ranks sharing one device (gloo carries its tensors: NCCL takes one rank a device):
    one fp32 Ulysses step of cpshard at cp=2 and greedy tokens of ``cpshard.generate``; the loss, the
    gradients and the tokens back on the CPU."""
    if device_type == "cuda":
        torch.cuda.init()
        torch.cuda.set_device(0)  # before the mesh, which would pick the device LOCAL_RANK names
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    mesh = cpshard.make_mesh(cp=2, device_type=device_type)
    model, batch = left_padded_llama(device, sizes)
    loss, grads = stepper(model, mesh)(batch)
    prompts = {key: batch[key] for key in ("input_ids", "attention_mask")}
    tokens = cpshard.generate(model, prompts, mesh, max_new_tokens=GENERATED, eos_token_id=None)
    return loss.item(), {name: grad.cpu() for name, grad in grads.items()}, tokens.cpu()


def cp2_parity(device, sizes: Sizes) -> list[Row]:
    """cp=2 over two ranks on ``device``, fp32, against the plain model's ``loss.backward()`` there: every
    tensor cpshard makes for a step (positions, masks, label counts, the checks' rows) must meet the model's
    on its device, which no CPU run shows."""
    (loss, grads, tokens), _ = cpshard.launch(cp2_rank, device.type, sizes, nprocs=2)
    model, batch = left_padded_llama(device, sizes)
    plain_loss = model(**batch).loss
    plain_loss.backward()
    plain = {name: p.grad.cpu() for name, p in model.named_parameters()}
    name = "cp=2 fp32 step on one device vs plain model"
    rows = agreement(
        name, (torch.tensor(loss), grads), (plain_loss.detach().cpu(), plain), None, torch.float32
    )
    prompts = {key: batch[key] for key in ("input_ids", "attention_mask")}
    expected = model.generate(**prompts, max_new_tokens=GENERATED, do_sample=False, eos_token_id=None).cpu()
    differing = int((tokens != expected).sum()) if tokens.shape == expected.shape else expected.numel()
    note = f"{GENERATED} new tokens a row, greedy, left-padded prompts"
    return rows + [Row("cp=2 generate on one device: tokens other than model.generate's", differing, 0, note)]


# ----------------------------------------------------------------------------- recurrent kernels


def delta_rule_inputs(dtype: torch.dtype, sizes: Sizes) -> tuple:
    """On the CPU: q, k, v, beta rounded to ``dtype``, g (the log decay) fp32, as Qwen3-Next makes them."""
    batch, length, k_heads, v_heads, dim = sizes.delta_rule
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, length, k_heads, dim, generator=generator) for _ in range(2))
    v = torch.randn(batch, length, v_heads, dim, generator=generator)
    g = F.logsigmoid(torch.randn(batch, length, v_heads, generator=generator) + 3)
    beta = torch.rand(batch, length, v_heads, generator=generator).sigmoid()
    return *(x.to(dtype) for x in (q, k, v)), g, beta.to(dtype)


def delta_rule(device, dtype, sizes: Sizes, kernel) -> list[Row]:
    """``kernel`` as the model calls it, in ``dtype``, against transformers' ``torch_chunk_gated_delta_rule``
    in fp32 on the same (rounded) inputs, run on the CPU: transformers takes its torch path there whatever is
    installed."""
    inputs = delta_rule_inputs(dtype, sizes)
    out, state = kernel(
        *(x.to(device) for x in inputs), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ref_out, ref_state = torch_chunk_gated_delta_rule(
        *(x.float() for x in inputs), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    label = str(dtype).removeprefix("torch.")
    return [
        Row(f"delta rule {label}: outputs vs torch", relative(out.cpu(), ref_out), TOLERANCE[dtype]),
        Row(f"delta rule {label}: final state vs torch", relative(state.cpu(), ref_state), TOLERANCE[dtype]),
    ]


def slice_summary(device, dtype, sizes: Sizes, kernel) -> list[Row]:
    """``kernel`` as cpshard's state passing calls it (:func:`delta_rule_summary`: fp32, the values widened
    by the identity) against the torch reference called so."""
    inputs = delta_rule_inputs(dtype, sizes)
    summary = delta_rule_summary(kernel, *(x.to(device) for x in inputs), use_qk_l2norm_in_kernel=True)
    reference = delta_rule_summary(torch_chunk_gated_delta_rule, *inputs, use_qk_l2norm_in_kernel=True)
    worst = max(relative(part.cpu(), ref) for part, ref in zip(summary, reference))
    return [Row("delta rule: cpshard's slice summary vs torch", worst, TF32_TOLERANCE, "fp32")]


def fla_delta_rule(device, dtype, sizes: Sizes) -> list[Row]:
    """fla's chunk gated delta rule against the torch reference, or a skipped row without fla."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:
        return [Row("delta rule: fla vs torch", None, None, f"skipped: fla not installed ({error})", "SKIP")]
    return guarded("delta rule", delta_rule, device, dtype, sizes, chunk_gated_delta_rule) + guarded(
        "delta rule: slice summary", slice_summary, device, dtype, sizes, chunk_gated_delta_rule
    )


# ----------------------------------------------------------------------------- main


def guarded(name: str, check, *args) -> list[Row]:
    """The rows of ``check(*args)``, or one failed row naming the error (its traceback on stderr)."""
    try:
        return check(*args)
    except Exception as error:
        traceback.print_exc()
        return [Row(name, None, None, f"{type(error).__name__}: {error}".splitlines()[0], "FAIL")]


def report(rows: list[Row]) -> str:
    return table(
        [
            (
                row.name,
                "-" if row.value is None else f"{row.value:.3g}",
                "-" if row.target is None else f"<= {row.target:g}",
                row.verdict,
                row.note,
            )
            for row in rows
        ],
        ("check", "measured", "target", "verdict", "note"),
        right=frozenset({1, 2}),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the default) or cpu")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the numerical checks in seconds")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device {args.device}: torch {torch.__version__} sees no CUDA device (built for CUDA "
            f"{torch.version.cuda}); run this on a machine with one, or pass --device cpu --quick for the "
            "CPU parts"
        )
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    sizes = SIZES["quick" if args.quick else "full"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, {dtype}, torch {torch.__version__}, {'quick' if args.quick else 'full'} sizes; {load()}")
    if OLDER_TORCH:
        print("torch below cpshard's floor (2.13): its collectives under their older names (see OLDER_TORCH)")
    rows = guarded("ring block", ring_block, device, dtype, sizes)
    rows += guarded("cp=1 process group", cp1_steps, device, dtype, sizes)
    rows += guarded("cp=2 on one device", cp2_parity, device, sizes)
    rows += guarded("delta rule", fla_delta_rule, device, dtype, sizes)
    print(report(rows))
    print(load())
    return int(any(row.verdict == "FAIL" for row in rows))


if __name__ == "__main__":
    sys.exit(main())
