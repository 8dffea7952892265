"""Postprocess stage service: serves the python models (stages) of a model repository, such as the example
ensembles' softmax, top-1 and pooling stages."""
