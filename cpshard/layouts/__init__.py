"""What context parallelism does to each architecture: the Layout type, its checks, the registry,
one table per file."""
