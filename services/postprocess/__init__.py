"""Postprocess stage service: turns model outputs (logits) into labels and probabilities."""
