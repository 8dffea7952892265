"""Model stage service: serves a model repository on TensorRT or PyTorch (CUDA, else CPU)."""
