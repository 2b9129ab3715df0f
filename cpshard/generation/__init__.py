"""Generation under cp: the prompt's prefill over a split cache, the decode step that reads it, sampling,
and ``generate`` that runs them, built on the training forward's pieces (:mod:`cpshard.runtime`)."""
