"""Processes and meshes, parameter placement, FSDP gathering, tensor and expert parallelism, checkpoints."""
