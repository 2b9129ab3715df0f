"""BLT as a causal LM (``BltForCausalLM``): bytes through a local encoder, patches of bytes through a global
transformer, bytes again through a local decoder.

Its model runs three stacks over two sequences, so there is no one list of layers to cut at: the model
(``model``) is the decoder whose entry cuts both sequences itself (:mod:`cpshard.recurrent.blt`), and the last
module before the head. The layers the layout names are the global transformer's (the stack of most
parameters and work: BLT's patches are a few bytes each), with its heads and its MLP (``mlp_tile``,
``attention_recompute`` act on them); the byte stacks' heads are checked where the call runs. Like XLM's,
a decoder cut at its entry without a tensor-parallel plan: cp alone (and fsdp).
"""

from dataclasses import replace

from cpshard.layouts.xlm import LAYOUT as XLM

# XLM's table (a decoder cut at its entry) with BLT's modules; its head shifts the labels as Llama's
# fmt: off
# a table: related rows share a line (the formatter would give each row its own)
LAYOUT = replace(
    XLM,
    name="blt", model_types=("blt",),
    decoder="model", final_norm="model",
    decoder_layers="model.global_transformer.layers", attention="self_attn",
    heads="global_config.num_attention_heads", kv_heads="global_config.num_key_value_heads",
    mlp_width="global_config.intermediate_size", mlp="mlp",
    labels_shifted=False, whole_inputs=("patch_lengths",),
)
# fmt: on
