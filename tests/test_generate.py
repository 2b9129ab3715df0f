"""Generation under cp against one process's ``model.generate``: tokens, the logits of every step, the
cache's bytes per rank and the bytes each decode step moves; on real gloo groups, tiny random models."""

from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.generation.sampling import Sampling, next_tokens
from cpshard.tools.tiny import tiny_batch, tiny_model

TOLERANCE = 1e-5
ROWS, LENGTH = 3, 23  # 23: cp pads the prompt (at cp=2 and 4, contiguous and head-tail)
GEMMA3_MIXED = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
#: models with Mamba1 mixers (a selective scan split over channels under cp)
MAMBA1 = ("jamba", "mamba", "falcon_mamba")


@dataclass(frozen=True)
class Case:
    model_type: str
    new_tokens: int = 16
    pad: str = "left"
    config: dict = field(default_factory=dict)
    implementation: str = "auto"

    def __str__(self):
        return f"{self.model_type}-{self.new_tokens}-{self.pad}-{self.implementation}-{self.config}"


def prompts(pad: str) -> dict:
    """Rows of unequal length (row 0 full), padded on ``pad``'s side; ``pad=None``: whole rows, no mask."""
    ids = torch.randint(3, 128, (ROWS, LENGTH), generator=torch.Generator().manual_seed(5))
    if pad is None:
        return {"input_ids": ids}
    mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
    mask[1, :7], mask[2, :3] = 0, 0
    if pad == "right":
        mask = mask.flip(1)
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def left_padded(batch: dict) -> dict:
    """The same prompts with their padding moved to the left."""
    shifts = (batch["attention_mask"] == 0).sum(1).tolist()
    roll = lambda x: torch.stack([row.roll(k) for row, k in zip(x, shifts, strict=True)])  # noqa: E731
    return {key: roll(value) for key, value in batch.items()}


def model_for(case: Case):
    model = tiny_model(case.model_type, attn_implementation="auto", **case.config)
    model.generation_config.eos_token_id = None  # exactly new_tokens tokens, as cpshard's eos_token_id=None
    return model


def run_generation(case: Case) -> dict:
    """On each rank: cpshard.generate's tokens, and a greedy loop of cp_prefill / cp_decode that records the
    logits of every step, the cache's bytes and the bytes of the decode steps."""
    model, batch = model_for(case), prompts(case.pad)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    tokens = cpshard.generate(model, batch, mesh, max_new_tokens=case.new_tokens, eos_token_id=None)
    params = cpshard.params_of(model)
    cp_prefill = cpshard.make_cp_prefill(model, implementation=case.implementation)
    cp_decode = cpshard.make_cp_decode(model)
    prefill = cpshard.debug.trace_comms(cp_prefill, params, batch, mesh)
    logits, cache = prefill.result
    steps, step_bytes = [logits], []
    for column in range(LENGTH, LENGTH + case.new_tokens - 1):
        report = cpshard.debug.trace_comms(cp_decode, params, tokens[:, column], cache, mesh)
        logits, cache = report.result
        steps.append(logits)
        step_bytes.append(report.total_bytes)
    # the prefill passes recurrent states (it hands them on), whatever the training forward would choose;
    # Mamba1's channel split is its only scheme
    scheme = "auto" if case.model_type in MAMBA1 else "state_passing"
    forward = cpshard.make_cp_forward(model, implementation=case.implementation, recurrent=scheme)
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    prompt = {**batch, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
    forward_bytes = cpshard.debug.trace_comms(forward, params, prompt, mesh).total_bytes
    return {
        "tokens": tokens,
        "logits": torch.stack(steps, 1),
        "cache_bytes": cache.nbytes,
        "states": dict(cache.recurrent),
        "step_bytes": step_bytes,
        "prefill_bytes": prefill.total_bytes,
        "forward_bytes": forward_bytes,
    }


def reference(case: Case):
    """One process: ``model.generate``'s tokens, the logits of every step, its cache's bytes."""
    model, batch = model_for(case), prompts(case.pad)
    if case.pad == "right":  # a right-padded row continues after its last real token: as left-padded
        batch = left_padded(batch)
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=case.new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    cache_bytes = sum(
        tensor.numel() * tensor.element_size()
        for layer in out.past_key_values.layers
        if isinstance(getattr(layer, "keys", None), torch.Tensor)
        for tensor in (layer.keys, layer.values)
    )
    return model, out, torch.stack(out.logits, 1), cache_bytes


def attention_layers(config) -> int:
    """How many cache layers hold attention (a hybrid's other layers are recurrent, whose states the cache
    carries, or work token by token; Inkling2-Loop's looped layers attend once per pass, each pass with a
    cache layer of its own)."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    own = sum(kind in ("full_attention", "sliding_attention", "hybrid", "hybrid_sliding") for kind in kinds)
    looped = getattr(config, "loop_layer_index_end", 0) - getattr(config, "loop_layer_index_start", 0)
    return own + looped * (getattr(config, "loop_num_passes", 1) - 1)


def decode_step_bytes(config) -> int:
    """Per decode step, on every rank: each attention layer all-gathers its ``[B, Hq, D + 1]`` fp32 partial
    output and log-sum-exp; the tokens (``[B]`` int64) and whether each rank's cache is its own (one more)
    are checked. A recurrent layer continues from its carried state on every rank alike: no bytes."""
    return (
        attention_layers(config) * ROWS * config.num_attention_heads * (config.head_dim + 1) * 4
        + (ROWS + 1) * 8
    )


def token_bytes(config) -> int:
    """One token's keys and values in every attention layer (fp32)."""
    return attention_layers(config) * 2 * ROWS * config.num_key_value_heads * config.head_dim * 4


def one_process_state(path: str, model, cache) -> torch.Tensor:
    """The state one process keeps for cpshard's cache path ``path``: in its cache (each delta rule's state,
    each convolution's inputs: transformers keeps ``kernel`` of them, cpshard the last ``kernel - 1``, all
    a decode step reads; MiniMax's lightning states apart; Inkling's four convolutions a layer, by their
    ``conv_idx``, a looped layer's later passes in the cache layers ``+offset`` after its own), or in the
    module (RecurrentGemma's)."""
    module, _, piece = path.partition(" ")
    if piece == "_rnn_scan":
        return model.get_submodule(module).rg_lru.recurrent_states
    if piece == "conv_1d":
        return model.get_submodule(module).conv1d_state
    number = int(path.split("layers.")[1].split(".")[0])
    if path.endswith("lightning"):
        return cache.linear_cache[number]
    if piece.startswith("conv"):  # "conv", or "conv+offset" for a later pass of a looped layer
        layer = cache.layers[number + int(piece.partition("+")[2] or 0)]
        return layer.conv_states[model.get_submodule(module).conv_idx][..., 1:]
    layer = cache.layers[number]
    return layer.conv_states[0][..., 1:] if path.endswith("conv1d_fn") else layer.recurrent_states[0]


def check_states(states: dict, model, cache, case: Case) -> None:
    """The carried recurrent states equal one process's after the same tokens (relative to the state's size
    past 1: Inkling2's MLP outputs reach 30, where float32 rounds at 2e-6), and cp carries every state one
    process keeps."""
    for path, state in states.items():
        own = one_process_state(path, model, cache)
        diff = (state - own).abs().max().item() / max(1.0, own.abs().max().item())
        assert diff <= TOLERANCE, f"{case}: {path} differs from one process's state by {diff}"
    linear = [layer for layer in getattr(cache, "layers", ()) if hasattr(layer, "recurrent_states")]
    held = sum(
        sum(layer.is_conv_states_initialized.values()) + sum(layer.is_recurrent_states_initialized.values())
        for layer in linear
    )
    held += sum(
        isinstance(state, torch.Tensor) and state.numel() > 0 for state in getattr(cache, "linear_cache", [])
    )
    held += 2 * sum(hasattr(module, "conv1d_state") for module in model.modules())
    assert len(states) == held, (case, sorted(states))  # every state one process keeps (LFM2's: a conv's)


def check_case(results: list[dict], case: Case):
    model, out, logits, cache_bytes = reference(case)
    sequences, cp = out.sequences, len(results)
    new = sequences[:, LENGTH:]
    for rank, result in enumerate(results):
        assert torch.equal(result["tokens"], results[0]["tokens"]), (
            f"{case}: rank {rank} generated other tokens"
        )
        assert torch.equal(result["tokens"][:, LENGTH:], new), (
            f"{case} rank {rank}: other tokens than generate"
        )
        assert torch.equal(result["tokens"][:, :LENGTH], prompts(case.pad)["input_ids"])
        diff = (result["logits"] - logits).abs().max().item()
        assert diff <= TOLERANCE, f"{case} rank {rank}: logits differ by {diff}"
        assert torch.equal(result["logits"], results[0]["logits"]), f"{case}: ranks' logits differ"
        assert set(result["step_bytes"]) == {decode_step_bytes(model.config)}, (
            f"{case}: {result['step_bytes']}"
        )
        check_states(result["states"], model, out.past_key_values, case)
        if (
            getattr(model.config, "sliding_window", None) or LENGTH
        ) >= LENGTH:  # (a window's own keys: not counted)
            # prefill: the forward's bytes, the last logits' all-reduce, and the all-reduces of each
            # convolution's last inputs and each scan's (and lightning layer's) final state (a delta rule's
            # every rank folds alike)
            conv = sum(
                s.numel() * 4
                for path, s in result["states"].items()
                if path.endswith(("conv1d_fn", "scan_combined", "lightning", "conv_1d", "_rnn_scan", " conv"))
            )
            # and each channel split's final states, all-gathered: every rank gives its channels' share
            conv += sum(
                s.numel() * 4 // cp for path, s in result["states"].items() if path.endswith("scan_fn")
            )
            assert (
                result["prefill_bytes"] == result["forward_bytes"] + ROWS * model.config.vocab_size * 4 + conv
            )
    per_rank = [result["cache_bytes"] for result in results]
    if case.model_type in LATENT_CACHES:
        cache_bytes = sum(per_rank)
    if case.pad != "right":  # a right-padded batch may keep more of a window: its rows' windows differ
        assert sum(per_rank) == cache_bytes, f"{case}: {per_rank} against one process's {cache_bytes}"
        assert max(per_rank) <= cache_bytes / cp * 1.01 + token_bytes(model.config), f"{case}: {per_rank}"


#: models whose one-process cache holds multi-head latent attention's compressed latent, where cpshard's
#: split cache holds each head's keys and values (what its log-sum-exp merge attends over): only their
#: balance over the ranks is compared
LATENT_CACHES = ("kimi_linear",)


CASES_CP2 = [
    Case("llama", 64),
    Case("qwen3", 64),
    Case("mistral", 64, config={"sliding_window": 8}),
    Case("gemma3_text", 64, config=GEMMA3_MIXED),
    Case("llama", 8, pad="right"),
    Case("gemma3_text", 8, pad="right", config=GEMMA3_MIXED),
    Case("llama", 8, implementation="ring"),
    Case("mistral", 8, config={"sliding_window": 8}, implementation="ring"),
    # hybrids: linear-attention layers carry their recurrent and convolution states from prefill to decode
    Case("qwen3_next", 16),
    Case("kimi_linear", 16),
    Case("olmo_hybrid", 16, pad=None),
    Case("nemotron_h", 16),  # Mamba2 (its scan's state), MoE, attention and MLP layers
    Case("bamba", 16, pad=None),
    Case("lfm2_moe", 16),  # short convolutions: only their last inputs are carried
    Case("falcon_h1", 16),  # attention and Mamba2 side by side: split keys and values, whole states
    Case("jamba", 16),  # Mamba1 split over channels: its final states gathered, then continued whole
    Case("minimax", 16),  # lightning attention: its state carried beside the split keys and values
    Case("zamba2", 16),  # its attention inside the hybrid layer's shared block, beside Mamba2
    Case("recurrent_gemma", 16),  # RG-LRU beside sliding-window attention: states kept in its modules
    # four short convolutions a layer carried, and attention with a relative position bias per query (and a
    # log scale in full layers) added to the split cache's keys where each rank holds them
    Case("inkling_text", 16),
    # the sequence cut where it enters the decoder (its block states per position), a sink logit per query
    # merged once after the ranks' parts; the looped layers carry keys, values and convolution states per pass
    Case("inkling2_text", 16),
    Case("inkling2_loop_text", 16),
]
CASES_CP4 = [
    Case("llama", 64),
    Case("qwen3", 64),
    Case("qwen3", 12, pad=None),
    Case("mistral", 64, config={"sliding_window": 8}),
    Case("gemma3_text", 64, config=GEMMA3_MIXED),
    Case("qwen3_5_text", 16),  # rank 3 holds the prompt's last token and one position of cp padding
    Case("granitemoehybrid", 16),
    Case("falcon_mamba", 16),
    Case("zamba2", 16),
    Case("minimax", 16),
    Case("recurrent_gemma", 16),
    Case("inkling_text", 16),
    Case("inkling2_text", 16),
    Case("inkling2_loop_text", 16),
]


@pytest.mark.parametrize("case", CASES_CP2, ids=str)
def test_greedy_cp2(ranks2, case):
    check_case(ranks2.run(run_generation, case), case)


@pytest.mark.parametrize("case", CASES_CP4, ids=str)
def test_greedy_cp4(ranks4, case):
    check_case(ranks4.run(run_generation, case), case)


def greedy_tokens(model_type: str) -> torch.Tensor:
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    model = model_for(Case(model_type))
    return cpshard.generate(model, prompts("left"), mesh, max_new_tokens=8, eos_token_id=None)


@pytest.mark.parametrize("model_type", ["gemma4_text", "gpt2"])
def test_derived_layouts_generate_as_one_process(ranks2, model_type):
    """Layouts derived from the model: probed through the training forward of the same model (a prefill
    gives no loss to compare); Gemma4's decoder reads logits_to_keep itself, so its prefill keeps its
    rows after the head (given this rank's indices, it gave logits off by 4)."""
    _, out, _, _ = reference(Case(model_type, 8))
    for tokens in ranks2.run(greedy_tokens, model_type):
        assert torch.equal(tokens, out.sequences), (tokens, out.sequences)


def test_mixture_of_experts_cp2(ranks2):
    case = Case("qwen3_moe", 8)
    check_case(ranks2.run(run_generation, case), case)


SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)


def run_sampling(seed: int | None, from_config: bool = False) -> torch.Tensor:
    """Sampled tokens, the settings given to generate or (``from_config``) in the model's generation config
    as a released model's sets them, with a penalty that changes nothing."""
    model = model_for(Case("llama"))
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    options = {"generator": generator}
    if from_config:
        model.generation_config.update(**SAMPLING, repetition_penalty=1.0)
    else:
        options |= SAMPLING
    return cpshard.generate(model, prompts("left"), mesh, max_new_tokens=12, eos_token_id=None, **options)


def sampled_by_one_process(seed: int) -> torch.Tensor:
    """transformers' forward with its own cache, and cpshard's token choice with the same generator."""
    model, batch = model_for(Case("llama")), prompts("left")
    sampling = Sampling(**SAMPLING)
    generator, mask = torch.Generator().manual_seed(seed), batch["attention_mask"]
    positions, inputs, cache, tokens = (mask.cumsum(1) - 1).clamp(min=0), batch["input_ids"], None, []
    with torch.no_grad():
        for _ in range(12):
            out = model(
                input_ids=inputs, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
            )
            tokens.append(next_tokens(out.logits[:, -1], sampling, generator))
            cache, inputs, positions = out.past_key_values, tokens[-1][:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(ROWS, 1, dtype=mask.dtype)], 1)
    return torch.cat([batch["input_ids"], torch.stack(tokens, 1)], 1)


def test_sampling_draws_the_same_tokens_on_every_rank(ranks2):
    seeded = ranks2.run(run_sampling, 7)
    assert torch.equal(seeded[0], seeded[1])
    assert torch.equal(seeded[0], sampled_by_one_process(7))
    unseeded = ranks2.run(run_sampling, None)  # one seed, rank 0's, for every rank
    assert torch.equal(unseeded[0], unseeded[1])
    configured = ranks2.run(run_sampling, 7, True)  # what the model's generation config says, as generate
    assert torch.equal(configured[0], seeded[0]) and torch.equal(configured[1], seeded[0])


def test_generate_falls_back_on_transformers_own_defaults():
    """cpshard's table of transformers' defaults is transformers' (greedy, top-k 50, no-op penalties)."""
    from transformers import GenerationConfig

    from cpshard.generation.generate import TRANSFORMERS_DEFAULTS

    own = GenerationConfig._get_default_generation_params()
    assert {name: own[name] for name in TRANSFORMERS_DEFAULTS} == TRANSFORMERS_DEFAULTS


def run_until_eos(eos: int) -> torch.Tensor:
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    return cpshard.generate(
        model_for(Case("llama")), prompts("left"), mesh, max_new_tokens=16, eos_token_id=eos
    )


def test_rows_stop_at_eos_and_are_padded_after_it(ranks2):
    model, out, _, _ = reference(Case("llama", 16))
    eos = int(out.sequences[1, LENGTH + 4])  # row 1's fifth new token: it stops there, or earlier
    with torch.no_grad():
        expected = model.generate(**prompts("left"), max_new_tokens=16, do_sample=False, eos_token_id=eos)
    for tokens in ranks2.run(run_until_eos, eos):
        assert torch.equal(tokens, expected)
    assert (expected[1, LENGTH + 5 :] == model.config.pad_token_id).all()


def error_messages(attempts) -> list[str]:
    """Each attempt's ValueError message ("no error" where it raised none)."""
    messages = []
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def check_refused(every_rank: list[list[str]], expected: list[str]) -> None:
    """Every rank raised each expected message, in order."""
    for messages in every_rank:
        for message, fragment in zip(messages, expected, strict=True):
            assert fragment in message, message


def _refusals() -> list[str]:
    model, batch = model_for(Case("llama")), prompts("left")
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    rank = dist.get_rank()
    attempts = {
        "beams": lambda: cpshard.generate(model, batch, mesh, max_new_tokens=4, num_beams=2),
        "speculative": lambda: cpshard.generate(model, batch, mesh, max_new_tokens=4, assistant_model=model),
        "other option": lambda: cpshard.generate(model, batch, mesh, max_new_tokens=4, use_cache=False),
        "temperature": lambda: cpshard.generate(
            model, batch, mesh, max_new_tokens=4, do_sample=True, temperature=0
        ),
        "labels": lambda: cpshard.make_cp_prefill(model)(
            cpshard.params_of(model), {**batch, "labels": batch["input_ids"]}, mesh
        ),
        "differs": lambda: cpshard.generate(
            model, {"input_ids": batch["input_ids"] + rank}, mesh, max_new_tokens=4
        ),
        "sinks": lambda: cpshard.generate(
            tiny_model("gpt_oss", attn_implementation="eager"), batch, mesh, max_new_tokens=4
        ),
        "tokens": lambda: cpshard.make_cp_decode(model)(
            cpshard.params_of(model),
            torch.full((ROWS,), 3 + rank),
            cpshard.make_cp_prefill(model)(cpshard.params_of(model), batch, mesh)[1],
            mesh,
        ),
    }
    cache = cpshard.make_cp_prefill(model)(cpshard.params_of(model), batch, mesh)[1]
    anothers = replace(cache, rank=(cache.rank + 1) % cache.size)
    attempts["stranger"] = lambda: cpshard.make_cp_decode(model)(
        cpshard.params_of(model), torch.full((ROWS,), 3), anothers, mesh
    )
    data_parallel = cpshard.make_mesh(dp_replicate=2, cp=1)
    attempts["mesh"] = lambda: cpshard.generate(model, batch, data_parallel, max_new_tokens=4)
    sharded = cpshard.params_of(cpshard.parallelize(model_for(Case("llama")), mesh))
    attempts["sharded"] = lambda: cpshard.make_cp_prefill(model)(sharded, batch, mesh)
    penalized = model_for(Case("llama"))
    penalized.generation_config.repetition_penalty = 1.3
    attempts["config"] = lambda: cpshard.generate(penalized, batch, mesh, max_new_tokens=4)
    # each rank's loop would stop after its own count of steps, its collectives mismatched (a gloo abort)
    attempts["steps"] = lambda: cpshard.generate(model, batch, mesh, max_new_tokens=3 + 3 * rank)
    attempts["refused on one rank"] = lambda: cpshard.generate(
        model, batch, mesh, max_new_tokens=4, **({"num_beams": 2} if rank == 1 else {})
    )
    return error_messages(attempts.values())


def test_what_is_not_served_is_refused_on_every_rank(ranks2):
    expected = [
        "beam search (num_beams=2)",
        "speculative decoding (assistant_model)",
        "does not take use_cache=False",
        "temperature=0",
        "holds input_ids and attention_mask only",
        "the batch differs across the cp group",
        "attention sinks",
        "ranks [1] decode other tokens",
        "ranks [0, 1] hold a cache that another rank or cp size made",
        "this mesh also has {'dp_replicate': 2}",
        "takes the plain parameters",
        "sets {'repetition_penalty': 1.3}",
        "ranks [1] were called otherwise than rank 0",
    ]
    every_rank = ranks2.run(_refusals)
    check_refused([messages[:-1] for messages in every_rank], expected)
    steps = [messages[-2] for messages in every_rank]  # each rank names the arguments that differ
    assert steps[0] == steps[1] and "(rank 0: max_new_tokens=3; rank 1: max_new_tokens=6); " in steps[0], (
        steps
    )
    assert "ranks [1] refused their arguments" in every_rank[0][-1], every_rank[0][-1]
    assert "beam search (num_beams=2)" in every_rank[1][-1], every_rank[1][-1]


def generation_under_autocast(model_type: str, new_tokens: int = 6) -> dict:
    """Under bf16 autocast: cpshard.generate's tokens and a prefill / decode loop's logits of every step,
    and model.generate's under the same autocast."""
    model, batch = model_for(Case(model_type)), prompts("left")
    mesh, params = cpshard.make_mesh(cp=dist.get_world_size()), cpshard.params_of(model)
    cp_decode = cpshard.make_cp_decode(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens = cpshard.generate(model, batch, mesh, max_new_tokens=new_tokens, eos_token_id=None)
        logits, cache = cpshard.make_cp_prefill(model)(params, batch, mesh)
        steps = [logits]
        for column in range(LENGTH, LENGTH + new_tokens - 1):
            logits, cache = cp_decode(params, tokens[:, column], cache, mesh)
            steps.append(logits)
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
    return {
        "tokens": tokens,
        "logits": torch.stack(steps, 1),
        "own tokens": out.sequences,
        "own logits": torch.stack(out.logits, 1),
    }


def steps_before_a_tie(result: dict, rtol: float) -> int:
    """The decoding steps before cp's tokens and one process's part. Where they part, one process's two best
    logits in each row that parts must lie within ``rtol`` of scale of each other: a tie that bf16's
    rounding breaks either way (GPT-2's row 2 at its fourth token: 2.7656 twice)."""
    own, parted = result["own logits"].float(), (result["tokens"] != result["own tokens"]).any(0).nonzero()
    if not len(parted):
        return own.shape[1]
    step = int(parted[0]) - LENGTH
    for row in (result["tokens"][:, LENGTH + step] != result["own tokens"][:, LENGTH + step]).nonzero():
        best, second = own[int(row), step].topk(2).values
        assert best - second <= rtol * own.abs().max(), (step, int(row), best, second)
    return step + 1  # the logits of the parting step itself were computed on the same tokens


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen3_next"])  # registered, probed, recurrent
def test_generation_under_autocast_is_one_process_s(ranks2, model_type):
    """cp_prefill and cp_decode were refused under autocast; they now give one process's tokens, and its
    logits at every step to bf16's rounding (up to a tie that rounding breaks, after which the two continue
    from different tokens)."""
    for result in ranks2.run(generation_under_autocast, model_type):
        steps = steps_before_a_tie(result, 5e-2)
        own, cp = result["own logits"][:, :steps], result["logits"][:, :steps]
        assert torch.equal(own, own.bfloat16().float())  # autocast acted: the head's logits are bf16's
        assert (cp.float() - own.float()).abs().max() <= 5e-2 * own.abs().max()


def run_attention_free_generation(model_type: str, new_tokens: int) -> dict:
    """cpshard.generate's tokens, and a greedy prefill / decode loop's logits of every step and the states it
    carries after the prompt and after the last decoded token."""
    model, batch = model_for(Case(model_type)), prompts("left")
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    tokens = cpshard.generate(model, batch, mesh, max_new_tokens=new_tokens, eos_token_id=None)
    params = cpshard.params_of(model)
    cp_decode = cpshard.make_cp_decode(model)
    logits, cache = cpshard.make_cp_prefill(model)(params, batch, mesh)
    steps, prefilled = [logits], dict(cache.recurrent)
    for column in range(LENGTH, LENGTH + new_tokens - 1):
        logits, cache = cp_decode(params, tokens[:, column], cache, mesh)
        steps.append(logits)
    return {
        "tokens": tokens,
        "logits": torch.stack(steps, 1),
        "prefilled": prefilled,
        "decoded": cache.recurrent,
    }


def recomputed_greedy(model, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's greedy tokens and the logits of every step, the whole sequence recomputed each step."""
    steps = []
    with torch.no_grad():
        for _ in range(new_tokens):
            steps.append(model(input_ids=ids, use_cache=False).logits[:, -1])
            ids = torch.cat([ids, steps[-1].argmax(-1, keepdim=True)], 1)
    return ids, torch.stack(steps, 1)


def rwkv_states(model, ids: torch.Tensor) -> dict:
    """One process's RWKV states after ``ids`` (its multi-token path), by cpshard's cache paths."""
    with torch.no_grad():
        state = model(input_ids=ids, use_cache=True).state
    states = {}
    for layer in range(model.config.num_hidden_layers):
        block = f"rwkv.blocks.{layer}"
        states[f"{block}.attention wkv"] = torch.stack([part[:, :, layer] for part in state[2:]])
        states[f"{block}.attention time_shift"] = state[1][:, :, layer]
        states[f"{block}.feed_forward time_shift"] = state[0][:, :, layer]
    return states


@pytest.mark.ranks  # its ranks come through getfixturevalue, which the marker's hook does not see
@pytest.mark.parametrize("model_type, cp", [("rwkv", 2), ("rwkv", 4), ("xlstm", 2), ("xlstm", 4)])
def test_attention_free_models_generate_as_one_process_recomputing_each_step(request, model_type, cp):
    """RWKV carries each block's WKV state and its token shifts' last inputs, xLSTM each mLSTM's memory,
    normaliser and stabiliser; the prefill takes the last logits of a model that ignores logits_to_keep
    (xLSTM) from every position's. The reference recomputes the whole sequence each step: transformers 5.25's
    own one-token paths are wrong for these tiny models (RWKV's adds its carried shift ``[B, C]`` to
    ``[B, 1, C]``: right for one row, checked below; xLSTM's cache assumes equal query and value widths)."""
    new_tokens = 12
    model, batch = model_for(Case(model_type)), prompts("left")
    ids, logits = recomputed_greedy(model, batch["input_ids"], new_tokens)
    expected = {}
    if model_type == "rwkv":
        with torch.no_grad():
            one_row = model.generate(input_ids=ids[:1, :LENGTH], max_new_tokens=new_tokens, do_sample=False)
        assert torch.equal(one_row, ids[:1])
        expected = {
            "prefilled": rwkv_states(model, ids[:, :LENGTH]),
            "decoded": rwkv_states(model, ids[:, : LENGTH + new_tokens - 1]),
        }
    for result in request.getfixturevalue(f"ranks{cp}").run(
        run_attention_free_generation, model_type, new_tokens
    ):
        assert torch.equal(result["tokens"], ids), (result["tokens"], ids)
        assert (result["logits"] - logits).abs().max().item() <= TOLERANCE
        assert result["decoded"].keys() == result["prefilled"].keys() != set()
        for when, states in expected.items():
            assert result[when].keys() == states.keys(), (when, sorted(result[when]))
            for path, state in states.items():
                scale = max(1.0, state.abs().max().item())
                diff = (result[when][path] - state).abs().max().item() / scale
                assert diff <= TOLERANCE, (cp, when, path, diff)


@pytest.mark.ranks  # its ranks come through getfixturevalue, which the marker's hook does not see
@pytest.mark.parametrize("cp", [2, 4])
def test_zaya_generates_as_one_process(request, cp):
    """ZAYA carries its projection's convolution inputs and delayed value beside the split keys and values:
    the tokens and every step's logits of ``model.generate``, and the carried states equal its cache's after
    the last token (the convolution's last ``kernel`` inputs, the last delayed value)."""
    case = Case("zaya", 16)
    _, out, logits, _ = reference(case)
    for result in request.getfixturevalue(f"ranks{cp}").run(run_generation, case):
        assert torch.equal(result["tokens"], out.sequences), (result["tokens"], out.sequences)
        assert (result["logits"] - logits).abs().max().item() <= TOLERANCE
        for path, state in result["states"].items():
            layer = out.past_key_values.layers[int(path.split("layers.")[1].split(".")[0])]
            own = layer.conv_states[0] if path.endswith("qk conv") else layer.recurrent_states[0][:, None]
            assert (state - own).abs().max().item() <= TOLERANCE, path
        assert len(result["states"]) == 2 * len(out.past_key_values.layers), sorted(result["states"])


def generate_at_cp1() -> str:
    model = model_for(Case("nemotron_h"))
    try:
        cpshard.generate(model, prompts("left"), cpshard.make_mesh(cp=1), max_new_tokens=2)
    except ValueError as error:
        return str(error)
    return "generated"


def test_recurrent_generation_at_cp1_is_refused():
    """At cp=1 no slot serves a split call, so none hands a state on (decode found no state, and said so
    as if the cache were another model's)."""
    with cpshard.LocalRanks(1, timeout=120) as ranks:
        (message,) = ranks.run(generate_at_cp1)
    assert "carries recurrent states from a prefill split over cp > 1 ranks" in message, message


def _recurrent_refusals() -> list[str]:
    model, mesh = model_for(Case("qwen3_next")), cpshard.make_mesh(cp=dist.get_world_size())
    params, batch = cpshard.params_of(model), prompts("left")
    cache = cpshard.make_cp_prefill(model)(params, batch, mesh)[1]
    attempts = [
        lambda: cpshard.generate(model, prompts("right"), mesh, max_new_tokens=4),
        lambda: cpshard.make_cp_decode(model)(
            params, torch.full((ROWS,), 3), replace(cache, recurrent={}), mesh
        ),
    ]
    return error_messages(attempts)


def test_what_recurrent_generation_does_not_serve_is_refused_on_every_rank(ranks2):
    expected = [
        "rows [1, 2] of the prompt have padding after a real token",
        "model.layers.0.linear_attn causal_conv1d_fn: the cache holds no state for this layer",
    ]
    check_refused(ranks2.run(_recurrent_refusals), expected)


def prefilled_states(length: int, model_type: str) -> tuple[torch.Tensor, dict]:
    model, mesh = model_for(Case(model_type)), cpshard.make_mesh(cp=dist.get_world_size())
    batch = {key: value[:, -length:] for key, value in prompts("left").items()}
    logits, cache = cpshard.make_cp_prefill(model)(cpshard.params_of(model), batch, mesh)
    return logits, dict(cache.recurrent)


@pytest.mark.parametrize(
    "model_type", ["qwen3_5_text", "nemotron_h", "recurrent_gemma", "inkling_text", "inkling2_text"]
)
@pytest.mark.parametrize("length", [9, 13])  # cp=4: rank 3 holds cp padding only; the last token on rank 3
def test_a_prefill_hands_on_the_states_of_one_process(ranks4, length, model_type):
    model = model_for(Case(model_type))
    batch = {key: value[:, -length:] for key, value in prompts("left").items()}
    with torch.no_grad():
        out = model(**batch, use_cache=True)
    for logits, states in ranks4.run(prefilled_states, length, model_type):
        assert (logits - out.logits[:, -1]).abs().max() <= TOLERANCE
        check_states(states, model, getattr(out, "cache", None), Case(model_type))  # RecurrentGemma's: None


def generation_refusal(model_type: str) -> str:
    model = tiny_model(model_type, attn_implementation="auto").eval()
    prompt = {"input_ids": tiny_batch(model.config.vocab_size, 2, 8)["input_ids"]}
    mesh = cpshard.make_mesh(cp=2)
    return error_messages([lambda: cpshard.generate(model, prompt, mesh, max_new_tokens=2)])[0]


@pytest.mark.parametrize(
    ("model_type", "name"),
    [("xlm", "XLM"), ("prophetnet", "ProphetNet"), ("reformer", "Reformer"), ("blt", "BLT")],
)
def test_layouts_that_do_not_generate_refuse_it_on_every_rank(ranks2, model_type, name):
    """Layout files whose models cp trains but does not generate with say so, naming the model."""
    for message in ranks2.run(generation_refusal, model_type):
        assert f"does not serve {name}" in message, message
