"""The sizes of the tiny models (:mod:`cpshard.tools.tiny`): :data:`SMALL` for every type, and
:data:`PER_TYPE` for the types whose defaults it leaves large or does not reach (experts, latent attention,
linear heads, hybrids' layer types, state-space mixers, the parts of a composite config): small enough that
every causal LM of transformers builds quickly on a CPU, with each kind of layer its released config has.
"""


def _experts(count: str = "num_experts", **more) -> dict:
    """Every mixture of experts here: 4 experts of width 32, 2 per token (``count``: the config's name for
    how many experts there are), and ``more``."""
    return {count: 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **more}


# fmt: off
# tables of sizes: a line holds several (the formatter would give each its own)
SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1 << 16, initializer_range=0.15,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    is_decoder=True,  # BERT-style models are causal LMs only as decoders (transformers warns otherwise)
)
#: multi-head latent attention (DeepSeek-V2/V3 and kin): small latent ranks, one group of routed experts
_LATENT_ATTENTION = dict(
    num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    n_group=1, topk_group=1,
)
#: DeepSeek's: few small experts, a dense first layer
_LATENT = dict(
    _LATENT_ATTENTION, **_experts("n_routed_experts"), q_lora_rank=32, head_dim=8, first_k_dense_replace=1
)
#: BART's family sizes its decoder apart (a causal LM of it is that decoder)
_SEQ2SEQ = dict(
    decoder_layers=2, encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4,
    decoder_ffn_dim=128, encoder_ffn_dim=128,
)
_SEQ2SEQ_TYPES = (
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
    "plbart", "whisper",
)
#: absolute position tables (and GPT-BigCode's causal mask buffer) are max_position_embeddings long
_ABSOLUTE = dict(max_position_embeddings=256)
#: hybrids of linear attention and sparse experts (Qwen3-Next and kin): few small experts and linear heads
_HYBRID_MOE = _experts(
    shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4,
)
#: a linear-attention layer, then an attention layer (a hybrid's own default gives two linear layers)
_HYBRID = dict(layer_types=["linear_attention", "full_attention"])
#: Kimi's linear hybrid: latent attention (its keys and values have every head) beside delta-rule layers
_KDA_LATENT = dict(
    _LATENT_ATTENTION,
    **_experts("num_local_experts"),
    q_lora_rank=None, linear_num_heads=4, linear_head_dim=16, num_mtp_layers=0,
)
#: mixtures of experts whose released sizes the shrinking does not reach (hundreds of experts of thousands of
#: units: 50M to 300M parameters each): four small experts, two a token, one group
_FEW_EXPERTS = _experts("n_routed_experts", n_group=1, topk_group=1)
#: Inkling: a sliding layer and a full one (log-scaled), small sliding heads, a window and a bias reach of a
#: few tokens
_INKLING = dict(
    _FEW_EXPERTS,
    layer_types=["hybrid_sliding", "hybrid"], swa_num_attention_heads=4, swa_num_key_value_heads=2,
    swa_head_dim=16, sliding_window_size=5, rel_extent=6, log_scaling_n_floor=2,
)
#: Inkling2: as Inkling, four layers in blocks of two (block states stacked at layers 0 and 2); Inkling2-Loop
#: in blocks of one, its middle two layers run in more than one pass
_INKLING2 = dict(
    _INKLING,
    num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    n_layers_per_attn_res_block=2, swa_head_dim=16,
    unpadded_vocab_size=SMALL["vocab_size"],  # the LM head's width (200058 by default)
)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=64)
#: sizes for model types that :data:`SMALL` does not cover (None: leave the config's own default); a
#: composite config's parts (its text, vision and audio configs) are looked up here by their own types
PER_TYPE = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "glm4_moe_lite"), _LATENT),
    # DeepSeek's sparse attention: a small indexer keeping 4 keys per query, fewer than the zoo's 11 tokens
    **dict.fromkeys(
        ("deepseek_v32", "glm_moe_dsa", "axk2"),
        dict(_LATENT, index_n_heads=2, index_head_dim=16, index_topk=4),
    ),
    **dict.fromkeys(("longcat_flash", "minicpm3", "sarvam_mla", "youtu", "axk1"), _LATENT),
    **dict.fromkeys(("gpt_bigcode", "openai-gpt", "gpt2", "biogpt", "xglm", "opt", "gpt_neo"), _ABSOLUTE),
    "gptj": dict(rotary_dim=8),
    "codegen": dict(rotary_dim=8),
    "gpt_neo": dict(**_ABSOLUTE, attention_types=[[["global", "local"], 1]], window_size=4),
    "falcon": dict(head_dim=None),
    # RWKV's inference-time rescaling divides weights in place in eval mode: cp refuses it (its probe runs so)
    "rwkv": dict(rescale_every=0),
    # a recurrent (RG-LRU) layer, then a sliding-window attention layer (its own default: two recurrent)
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], attention_window_size=16),
    # its indexer scores keys with the q heads of k/v head 0 (two here); a sliding and an indexed layer, whose
    # selection is small enough to choose among the keys of a short sequence
    "kolibri1_1": dict(
        index_num_heads=2, layer_types=["sliding_attention", "indexed_attention"], index_topk=2,
        index_pool_size=4, index_compression=2, index_num_local_tokens=2, index_num_sink_tokens=1,
    ),
    "phimoe": dict(router_jitter_noise=0.0),  # random in training: no two runs would agree
    "mamba2": dict(num_heads=8, head_dim=16),  # hidden_size * expand = num_heads * head_dim
    **dict.fromkeys(_SEQ2SEQ_TYPES, _SEQ2SEQ),
    # its decoder builds [M, M] buckets and masks of max_position_embeddings in every forward: its own 512
    "prophetnet": dict(
        num_hidden_layers=None, num_encoder_layers=2, num_decoder_layers=2, max_position_embeddings=512
    ),
    "zamba": dict(num_hidden_layers=3),
    # axial position embeddings take exactly prod(axial_pos_shape) tokens in training (its gradients' mode)
    "reformer": dict(axial_pos_embds=False, max_position_embeddings=256),
    "qwen3_moe": _experts(num_experts=8, decoder_sparse_step=1, mlp_only_layers=[0]),
    # configs whose validators or models need more than SMALL, and the parts of composite configs;
    # Gemma 4's drafter: a text model without per-layer inputs that reads all its keys and values from
    # the target model
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=SMALL["vocab_size"]),
    "xlnet": dict(max_position_embeddings=None, d_head=SMALL["head_dim"]),  # no position limit to set
    # XLM's causal LM is its causal model (its default, causal=False, is a masked LM: refused)
    "xlm": dict(_ABSOLUTE, causal=True),
    "dbrx": dict(
        d_model=SMALL["hidden_size"],  # its feed-forward's width is copied from d_model, not hidden_size
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),  # as released; rope_theta read here
        ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),
    ),
    "dots1": _experts("n_routed_experts", n_shared_experts=1),
    "lfm2_moe": _experts(layer_types=["full_attention", "conv"], num_dense_layers=1),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], mamba_d_state=16),
    # LFM2's short convolutions beside attention
    "lfm2": dict(layer_types=["full_attention", "conv"]),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    # its rotary embedding reads the parameters per layer type
    "cohere_compass_text": dict(
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e4)}
    ),
    **dict.fromkeys(("qwen3_next", "qwen3_5_moe_text"), dict(**_HYBRID_MOE, **_HYBRID)),
    **dict.fromkeys(("qwen3_5_text", "lara_mini"), _HYBRID),
    "qwen4_exp_text": dict(**_HYBRID_MOE, hc_lowrank=16),
    # KDA beside multi-head latent attention: small latents, few experts, small linear heads
    **dict.fromkeys(("kimi_linear", "bailing_hybrid"), dict(_KDA_LATENT, **_HYBRID)),
    "minimax": dict(block_size=8, num_local_experts=4),
    # Mamba2 beside attention: a few small SSD heads in groups, the torch scan's chunk of 64
    "bamba": dict(_MAMBA2, attn_layer_indices=[1]),
    "falcon_h1": dict(_MAMBA2, mamba_d_ssm=128),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, num_experts=4),
    "granitemoehybrid": dict(
        _MAMBA2,
        layer_types=["linear_attention", "full_attention"], num_local_experts=4,
        shared_intermediate_size=32,
    ),
    "nemotron_h": dict(
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=64,
        n_routed_experts=4, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    ),
    "gemma4_text": dict(vocab_size_per_layer_input=SMALL["vocab_size"]),
    # the patcher's threshold near the median of its entropies at init: patches of 1 to 7 bytes, and rows of
    # fewer patches than others (a byte's own patch alone leaves the cross-attention's q and k no gradient)
    "blt": dict(encoder_hash_byte_group_vocab=64, patching_threshold=4.39),
    **dict.fromkeys(
        ("blt_local_encoder", "blt_local_decoder"), dict(hidden_size_global=SMALL["hidden_size"])
    ),
    "dots3_note_text": dict(
        _LATENT,
        shared_experts_intermediate_size=32, index_n_heads=2, index_head_dim=16, index_topk=4,
        num_key_value_heads=4,
    ),
    "dots3_note_vision_encoder": dict(
        mlp_layer_types=["dense"] * SMALL["num_hidden_layers"], adapter_in_dim=SMALL["hidden_size"],
        adapter_out_dim=SMALL["hidden_size"],
    ),
    "dots3_note_audio_encoder": dict(
        adapter_input_size=SMALL["hidden_size"], adapter_out_dim=SMALL["hidden_size"],
        downsample_hidden_size=32,
    ),
    **dict.fromkeys(("mimo_v2_flash", "solar_open"), _FEW_EXPERTS),
    # DeepSeek's sparse attention with sinks and a gate: a small indexer keeping 4 keys per query in its first
    # layer, which its second layer reuses ("shared"), over a residual stream of four copies
    "hy_v4": dict(
        _LATENT, index_n_heads=2, index_head_dim=16, index_topk=4, indexer_types=["full", "shared"]
    ),
    # DeepSeek-V4: a sliding layer (a window of 4 keys), a compressed sparse one (CSA: windows of 3 tokens
    # pooled into keys, a small indexer keeping 2 of them per query) and a heavily compressed one (HCA:
    # windows of 4), over a residual stream of four copies: the zoo's 11 tokens fill windows on both ranks
    # and across them
    "deepseek_v4": dict(
        _FEW_EXPERTS,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 4},
        sliding_window=4, index_n_heads=2, index_head_dim=8, index_topk=2, q_lora_rank=32, o_lora_rank=16,
        o_groups=2,
    ),
    "inkling_text": _INKLING,
    "inkling2_text": _INKLING2,
    # at the default init its passes amplify fp32 rounding: its own cached generate and its own forward
    # over the whole sequence differ by 3e-5 of its logits; at this init by 1e-6
    "inkling2_loop_text": dict(
        _INKLING2,
        n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=3,
        initializer_range=0.05,
    ),
    "ergo": _experts(shared_intermediate_size=32, first_dense_intermediate_size=64),
    "kolibri1": _experts("num_local_experts", shared_expert_intermediate_size=32),
    "hy_v3": _experts(),
    "phi4_multimodal_audio": dict(
        num_blocks=1, ext_pw_out_channel=64, depthwise_separable_out_channel=64, nemo_conv_channels=32
    ),
}
# fmt: on
