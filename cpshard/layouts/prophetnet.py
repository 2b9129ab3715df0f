"""ProphetNet's causal LM (``ProphetNetForCausalLM``): a main stream and ``ngram`` predict streams, each
cut on its own sequence.

Its decoder builds the streams, their relative-position buckets and masks on the whole sequence and
concatenates the streams along the sequence dim; they are cut where they enter the first layer (``hidden``:
the streams apart, ``b n s d``), by the decoder's hooks (``cut_at_entry``:
:mod:`cpshard.recurrent.prophetnet`), which also run its n-stream attention whole on the gathered streams
(no registry function computes it) and hand the streams back at the sequence's length after the last layer
(``restores_length``: the causal LM splits them by it; no module runs between the last layer and the head,
so the list of layers stands in for the final norm). Its logits are the first predict stream's, and its
loss every stream's against the same labels, each position's label its own token (``labels_shifted``,
``stream_logits``). No tensor-parallel plan: a decoder cut at its entry runs with cp alone.
"""

from dataclasses import replace

from cpshard.layouts.layout import specs
from cpshard.layouts.xlm import LAYOUT as XLM

# XLM's table (a decoder cut at its entry, its head reading each position's label as its own token) with
# ProphetNet's modules and streams
# fmt: off
# a table: related rows share a line (the formatter would give each row its own)
LAYOUT = replace(
    XLM,
    name="prophetnet", model_types=("prophetnet",),
    decoder="prophetnet.decoder", decoder_layers="prophetnet.decoder.layers", attention="self_attn",
    final_norm="prophetnet.decoder.layers",
    heads="num_decoder_attention_heads", mlp_width="decoder_ffn_dim",
    hidden=specs("b n s d", "b n s@cp d"), restores_length=True, stream_logits="logits_ngram",
)
# fmt: on
