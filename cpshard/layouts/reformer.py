"""Reformer as a causal LM (``ReformerModelWithLMHead``, ``is_decoder=True``).

Reformer's layers are reversible and its attention (LSH and local) is its own code over the whole sequence
per head, outside transformers' registry. So the sequence is cut where it enters the encoder (after the
embeddings and axial positions, whole), the encoder runs the rank's rows, and each attention runs on a share
of the heads over the gathered sequence (:mod:`cpshard.recurrent.reformer`); the model (``reformer``) is the
decoder whose entry installs it, the encoder the last module before the head. Like XLM's, a decoder cut at
its entry without a tensor-parallel plan: cp alone (and fsdp).
"""

from dataclasses import replace

from cpshard.layouts.xlm import LAYOUT as XLM

# XLM's table (a decoder cut at its entry) with Reformer's modules; its head reads labels unshifted
# fmt: off
# a table: related rows share a line (the formatter would give each row its own)
LAYOUT = replace(
    XLM,
    name="reformer", model_types=("reformer",),
    decoder="reformer", decoder_layers="reformer.encoder.layers", attention="attention",
    final_norm="reformer.encoder", labels_shifted=False,
)
# fmt: on
