"""The stage runtime, and the API a stage is written against: a `model.py` in a model repository imports
`Stage`, `TensorSpec` and the errors for inputs it cannot use from here.

    from pipeline.stage import InvalidInput, Stage, TensorSpec
"""

from pipeline.protocol.errors import InvalidInput, ItemError
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import Stage

__all__ = ["InvalidInput", "ItemError", "Stage", "TensorSpec"]
