"""Training: the RL loop, the supervised warm-start, losses, checkpointing, metrics."""
