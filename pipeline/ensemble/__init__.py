"""Ensembles: the YAML schema, Triton's `config.pbtxt` ensembles, and their compiled, immutable plans."""
