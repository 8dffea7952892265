"""The model of a TorchServe archive's folder (`pipeline.runtime.torchserve_store`): a `TritonPythonModel`
whose instances are TorchServe's workers.

Each instance unpacks the archive into a folder of its own (the handler's `model_dir`, removed at unload),
loads its handler there (`pipeline.stage.torchserve.handler_service`), and runs each batch the router gathers
(up to `batch_size` requests, waiting at most `max_batch_delay`) as one call of the handler. An instance on a
GPU gives the handler its `gpu_id`; one on the CPU gives none, as TorchServe does without GPUs.

A model that runs one method of a split handler (`pipeline.stage.torchserve.handler_parts`) loads the handler
the same way, under the archive's model name, and runs that method on its batches. Where the archive's
requirements.txt was installed (`install_py_dep_per_model`), that folder is on the process's path.
"""

from __future__ import annotations

import json
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.protocol.errors import RepositoryError
from pipeline.runtime.torchserve_store import (
    ARCHIVE_PARAMETER,
    DATA_TENSOR,
    PART_PARAMETER,
    PARTS,
    REQUEST_TENSOR,
    RESPONSE_TENSOR,
    STATE_TENSOR,
    read_manifest,
)
from pipeline.stage import triton_python_backend_utils as pb_utils
from pipeline.stage.torchserve.handler_parts import HandlerPart
from pipeline.stage.torchserve.handler_service import HandlerService


class TritonPythonModel:
    """An archive's handler, run on the batches of its model."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        parameters = {
            key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()
        }
        archive = Path(parameters.get(ARCHIVE_PARAMETER, ""))
        name = parameters.get("torchserve_model_name") or args["model_name"]
        if not archive.is_file():
            raise RepositoryError(f"model '{name}': its archive {archive} is not there")
        manifest = read_manifest(archive)
        self._folder = tempfile.TemporaryDirectory(prefix=f"torchserve-{name}-")
        model_dir = Path(self._folder.name)
        with zipfile.ZipFile(archive) as mar:
            mar.extractall(model_dir)  # NOTE: zipfile keeps every member inside model_dir
        gpu_id = int(args["model_instance_device_id"]) if args.get("model_instance_kind") == "GPU" else None
        batch_size = int(config.get("max_batch_size", 1) or 1)
        part = parameters.get(PART_PARAMETER)
        dependencies = parameters.get("torchserve_dependencies")
        if dependencies and dependencies not in sys.path:
            # The archive's requirements.txt, installed at start-up: after the service's own packages, which
            # they must not replace under the other models of the process.
            sys.path.append(dependencies)
        try:
            self.service = HandlerService(name, model_dir, manifest, batch_size, gpu_id)
            self.part = None if part is None else HandlerPart(self.service, part)
        except BaseException:
            self._folder.cleanup()
            raise

    def execute(self, requests: list[Any]) -> list[Any]:
        part = None if self.part is None else self.part.part
        inputs = (REQUEST_TENSOR,) if part in (None, PARTS[0]) else (DATA_TENSOR, STATE_TENSOR)
        outputs = (RESPONSE_TENSOR,) if part in (None, PARTS[2]) else (DATA_TENSOR, STATE_TENSOR)
        responses = []
        for request in requests:
            rows = [_rows(request, name) for name in inputs]
            results = [self.service.predict(rows[0])] if self.part is None else self.part.run(rows)
            tensors = []
            for name, elements in zip(outputs, results, strict=True):
                out = np.empty((len(elements), 1), dtype=object)
                out[:, 0] = elements
                tensors.append(pb_utils.Tensor(name, out))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def finalize(self) -> None:
        self._folder.cleanup()


def _rows(request: Any, name: str) -> list[bytes]:
    """A request's BYTES input `name`, an element per row."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise pb_utils.TritonModelException(f"a request without its input {name}")
    return [bytes(row) for row in tensor.as_numpy().reshape(-1)]
