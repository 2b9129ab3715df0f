"""Context-parallel attention: Ulysses, ring and hybrid around the model's own attention function,
with exact masks."""
