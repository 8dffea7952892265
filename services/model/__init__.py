"""Model stage service: runs the trained networks on a backend (PyTorch now, TensorRT later)."""
