"""Integrations with other training stacks (optional extras): ``cpshard.integrations.transformers``."""
