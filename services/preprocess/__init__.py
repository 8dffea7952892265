"""Preprocess stage service: decodes and normalises raw inputs (images) into model tensors."""
