"""Model service: serves the ONNX, PyTorch (TorchScript, torch.export) and TensorRT models of a Triton model
repository, on ONNX Runtime, PyTorch (CUDA, else CPU) or TensorRT."""
