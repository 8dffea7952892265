"""Preprocess stage service: serves the python models (stages) of a model repository, such as the example
ensembles' decoding, normalising and tokenising stages."""
