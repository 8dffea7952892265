"""GPU tests: collected everywhere, skipped (with the reason) where CUDA or TensorRT is missing."""
