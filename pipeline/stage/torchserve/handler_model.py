"""The model of a TorchServe archive's folder (`pipeline.runtime.torchserve_store`): a `TritonPythonModel`
whose instances are TorchServe's workers.

Each instance unpacks the archive into a folder of its own (the handler's `model_dir`, removed at unload),
loads its handler there (`pipeline.stage.torchserve.handler_service`), and runs each batch the router gathers
(up to `batch_size` requests, waiting at most `max_batch_delay`) as one call of the handler. An instance on a
GPU gives the handler its `gpu_id`; one on the CPU gives none, as TorchServe does without GPUs.
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.protocol.errors import RepositoryError
from pipeline.runtime.torchserve_store import (
    ARCHIVE_PARAMETER,
    REQUEST_TENSOR,
    RESPONSE_TENSOR,
    read_manifest,
)
from pipeline.stage import triton_python_backend_utils as pb_utils
from pipeline.stage.torchserve.handler_service import HandlerService


class TritonPythonModel:
    """An archive's handler, run on the batches of its model."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        parameters = {
            key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()
        }
        archive = Path(parameters.get(ARCHIVE_PARAMETER, ""))
        name = args["model_name"]
        if not archive.is_file():
            raise RepositoryError(f"model '{name}': its archive {archive} is not there")
        manifest = read_manifest(archive)
        self._folder = tempfile.TemporaryDirectory(prefix=f"torchserve-{name}-")
        model_dir = Path(self._folder.name)
        with zipfile.ZipFile(archive) as mar:
            mar.extractall(model_dir)  # NOTE: zipfile keeps every member inside model_dir
        gpu_id = int(args["model_instance_device_id"]) if args.get("model_instance_kind") == "GPU" else None
        batch_size = int(config.get("max_batch_size", 1) or 1)
        try:
            self.service = HandlerService(name, model_dir, manifest, batch_size, gpu_id)
        except BaseException:
            self._folder.cleanup()
            raise

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, REQUEST_TENSOR)
            if tensor is None:
                raise pb_utils.TritonModelException(f"a request without its input {REQUEST_TENSOR}")
            rows = tensor.as_numpy().reshape(-1)
            answers = self.service.predict([bytes(row) for row in rows])
            out = np.empty((len(answers), 1), dtype=object)
            out[:, 0] = answers
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(RESPONSE_TENSOR, out)])
            )
        return responses

    def finalize(self) -> None:
        self._folder.cleanup()
