"""Models written for Triton's Python backend (`TritonPythonModel`), served unmodified by the python backend
(`pipeline.stage.python_backend`): their config, the `args` their `initialize` gets, and their instances."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import Message

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import InvalidInput, PipelineError, RepositoryError
from pipeline.protocol.model_config import (
    set_tensor_specs,
    tensor_specs,
)
from pipeline.protocol.proto_json import message_json
from pipeline.runtime.repository import RepositoryEntry
from pipeline.stage import triton_python_backend_utils as pb_utils
from pipeline.stage.api import NO_DEADLINE, Deadline
from pipeline.stage.backend import PreparedVersion
from pipeline.stage.model_file import SharedModule, cause, device_of, instance_placements, where


def prepare_triton(
    entry: RepositoryEntry, version: str, path: Path, cls: type, module: SharedModule
) -> PreparedVersion:
    """A version of a `TritonPythonModel`: its config, checked, and one unloaded instance per placement."""
    if not entry.has_config or not (entry.config.input and entry.config.output):
        raise RepositoryError(
            f"{path}: a TritonPythonModel needs a config.pbtxt beside its version folders that declares its "
            f"input and output tensors, as Triton's Python backend does ({entry.folder / 'config.pbtxt'})"
        )
    if not callable(getattr(cls, "execute", None)):
        raise RepositoryError(f"{path}: TritonPythonModel has no execute(requests) method")
    config = mc.ModelConfig()
    config.CopyFrom(entry.config)
    config.backend = "python"
    config.platform = config.platform or "python"
    placements = instance_placements(config)
    inputs, outputs = tensor_specs(config, entry.source)
    set_tensor_specs(config, inputs, outputs)
    model_config = json.dumps(triton_json(config))
    instances = []
    for instance_name, kind, device_id in placements:
        args = {
            "model_config": model_config,
            "model_instance_kind": kind,
            "model_instance_name": instance_name,
            "model_instance_device_id": str(device_id),
            "model_repository": str(entry.folder),
            "model_version": version,
            "model_name": entry.name,
        }
        instances.append(
            TritonInstance(
                cls, args, [spec.name for spec in outputs], device_of(kind, device_id), path, module
            )
        )
    return PreparedVersion(config, list(instances))


def triton_json(message: Message) -> dict[str, Any]:
    """A config as Triton's Python backend hands it to `initialize`: protobuf's JSON mapping in the proto's
    field names, every field present, and 64-bit integers as numbers (protobuf writes them as strings; Triton
    converts them back)."""
    return message_json(message, every_field=True)


class TritonInstance:
    """One instance of a `TritonPythonModel`: `initialize` at load, `execute` per batch, `finalize` at unload."""

    inline = False

    def __init__(
        self,
        cls: type,
        args: dict[str, str],
        outputs: list[str],
        device: str,
        path: Path,
        module: SharedModule,
    ) -> None:
        self.device = device
        self.reason = f"Triton Python model (TritonPythonModel) from {path}"
        self._cls = cls
        self._args = args
        self._outputs = outputs
        self._path = path
        self._module = module
        self._model: Any = None

    def load(self) -> None:
        self._module.acquire()
        try:
            model = self._cls()
            initialize = getattr(model, "initialize", None)
            if initialize is not None:
                initialize(dict(self._args))
        except Exception as exc:
            self._module.release()
            raise RepositoryError(
                f"{self._path}: TritonPythonModel.initialize failed: {where(exc, self._path)}{cause(exc)}"
            ) from exc
        self._model = model

    def run(
        self, inputs: Mapping[str, np.ndarray], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, np.ndarray]:
        remaining = deadline.remaining()
        request = pb_utils.InferenceRequest(
            model_name=self._args["model_name"],
            inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
            requested_output_names=self._outputs,
            timeout=0 if remaining is None else max(1, int(remaining * 1e6)),
            cancelled=deadline.expired,
        )
        try:
            responses = self._model.execute([request])
        except pb_utils.TritonModelException as exc:
            raise InvalidInput(str(exc)) from None
        if not isinstance(responses, list | tuple) or len(responses) != 1:
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute must return a list of one InferenceResponse per "
                f"request; for 1 request it returned {_describe(responses)}"
            )
        response = responses[0]
        if not isinstance(response, pb_utils.InferenceResponse):
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute returned {_describe(response)} instead of an "
                "InferenceResponse"
            )
        error = response.error()
        if error is not None:
            raise InvalidInput(error.message())
        outputs = {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}
        missing = [name for name in self._outputs if name not in outputs]
        if missing:
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute returned no output {', '.join(missing)} "
                f"(it returned: {', '.join(outputs) or 'none'})"
            )
        return {name: np.asarray(outputs[name]) for name in self._outputs}

    def unload(self) -> None:
        model, self._model = self._model, None
        if model is None:
            return
        try:
            finalize = getattr(model, "finalize", None)
            if finalize is not None:
                finalize()
        finally:
            self._module.release()


def _describe(value: object) -> str:
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__
