"""The Open Inference Protocol as every process speaks it: errors, datatypes, the tensor codec and Triton's
model-configuration rules. Nothing here serves, routes or runs a model."""
