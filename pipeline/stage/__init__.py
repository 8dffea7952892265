"""The stage runtime, and the API a stage is written against."""

from pipeline.protocol.errors import InvalidInput, ItemError
from pipeline.stage.api import Stage, TensorSpec

__all__ = ["InvalidInput", "ItemError", "Stage", "TensorSpec"]
