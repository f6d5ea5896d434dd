"""fleet: Fleet-style distributed training for PyTorch."""
