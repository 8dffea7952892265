"""An inference serving system: stage services chained by a DAG router over the Open Inference Protocol."""

__version__ = "0.1.0"
