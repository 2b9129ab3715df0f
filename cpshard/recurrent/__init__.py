"""Linear-attention layers under context parallelism, served by state passing (docs: RECURRENT.md)."""
