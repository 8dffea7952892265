"""A stage's result as the protocol's response: checked against the outputs it declares, then encoded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import Tensor, infer_response
from pipeline.protocol.datatypes import DATATYPES, datatype_of
from pipeline.protocol.types import TensorSpec


def stage_response(
    model: str,
    version: str,
    request_id: str,
    wanted: Sequence[str],
    result: Mapping[str, np.ndarray],
    specs: Mapping[str, TensorSpec],
    batch: int | None,
    *,
    model_order: bool = False,
) -> pb.ModelInferResponse:
    """Check a stage's result against its declared outputs and build the response: its outputs in the
    order of `wanted`, or (`model_order`, as Triton answers for a decoupled model) in the order the model
    set them."""
    if model_order:
        position = {name: index for index, name in enumerate(result)}
        wanted = sorted(wanted, key=lambda name: position.get(name, len(position)))
    tensors = []
    for name in wanted:
        if name not in result:
            raise RuntimeError(f"model '{model}' returned no output '{name}'")
        array = np.asarray(result[name])
        spec = specs[name]
        if datatype_of(array) != spec.datatype and spec.datatype != "BYTES":
            array = array.astype(DATATYPES[spec.datatype])
        if batch is not None and (array.ndim == 0 or array.shape[0] != batch):
            raise RuntimeError(
                f"model '{model}' output '{name}' has shape {list(array.shape)}, expected batch {batch}"
            )
        tensors.append(Tensor.from_array(name, array))
    return infer_response(model, version, request_id, tensors)
