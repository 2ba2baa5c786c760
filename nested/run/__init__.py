"""Running experiments: configs, the training loop, checkpoints, memory sessions, metrics,
sharding and the command-line helpers."""
