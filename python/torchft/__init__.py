"""torchft: per-step fault tolerance for PyTorch training."""
