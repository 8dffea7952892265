"""TorchServe's helpers for handlers."""
