"""The stage runtime, and the API a stage is written against: a `model.py` in a model repository imports
`Stage`, `TensorSpec`, the errors for inputs it cannot use, and `DeadlineExceeded` for a call whose deadline
passed (`Stage.expired()`), from here.

    from pipeline.stage import DeadlineExceeded, InvalidInput, Stage, TensorSpec
"""

from pipeline.protocol.errors import DeadlineExceeded, InvalidInput, ItemError
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import Stage

__all__ = ["DeadlineExceeded", "InvalidInput", "ItemError", "Stage", "TensorSpec"]
