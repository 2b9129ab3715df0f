"""The command line and what it runs: demo, check, parity, bench and its baselines (nothing in
cpshard imports these)."""
