"""Fitting the base model in memory and time: block swap, float8 weights, offloaded checkpointing, torch.compile."""
