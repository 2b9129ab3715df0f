"""cp_forward and what it runs on: the batch, the cut, recompute under checkpointing, gradients."""
