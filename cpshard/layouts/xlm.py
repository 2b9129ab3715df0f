"""XLM as a causal LM (``config.causal=True``; with ``causal=False`` it is a masked LM, refused).

XLM has no layer module: its model (``transformer``) runs lists of attentions, norms and FFNs from its own
loop, post-norm, multiplying the stream by its padding mask between them. So the sequence is cut where it
enters the model (``cut_at_entry``: :mod:`cpshard.recurrent.xlm`), its loop then holds the rank's rows only;
the layers are the attention modules themselves (rewritten onto the registry:
:mod:`cpshard.layouts.family_attention`), and the last module before the head is the model itself (the
order stays contiguous: nothing is undone there). Its head's loss reads each position's label as its own
token (``labels_shifted``). No tensor-parallel plan: a decoder cut at its entry runs with cp alone.
"""

from dataclasses import replace

from cpshard.layouts.llama import LAYOUT as LLAMA

# Llama's table with XLM's rows (``replace``: ``with_rows`` would merge Llama's tensor-parallel plan)
# fmt: off
# a table: related rows share a line (the formatter would give each row its own)
LAYOUT = replace(
    LLAMA,
    name="xlm", model_types=("xlm",),
    decoder="transformer", decoder_layers="transformer.attentions", attention="", final_norm="transformer",
    kv_heads=None, mlp_width=None,
    layer_inputs=(), tensor_parallel={}, tensor_parallel_inputs=(), mlp=None,
    labels_shifted=True, cut_at_entry=True,
)
# fmt: on
