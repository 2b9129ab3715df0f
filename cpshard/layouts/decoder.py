"""The generic transformers decoder: every default of :class:`cpshard.layouts.layout.Layout`.

Serves any causal LM with ``model.layers`` of decoder layers that take ``position_embeddings``
and a ``self_attn`` that calls attention through transformers' registry.
"""

from cpshard.layouts.layout import Layout

LAYOUT = Layout("decoder")
