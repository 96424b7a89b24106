"""Watching a run: trackers (TensorBoard, wandb), throughput, step profiling, free disk space."""
