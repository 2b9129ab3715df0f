"""Cross-entropy, the loss without logits (a block of tokens at a time), the LM head and the router loss."""
