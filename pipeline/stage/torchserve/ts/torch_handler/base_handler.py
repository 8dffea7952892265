"""`BaseHandler`, the class TorchServe's custom handlers subclass: `initialize(context)` loads the archive's
model (TorchScript, or a model file's one `nn.Module` class with its state dict), `handle(data, context)` runs
`preprocess`, `inference` and `postprocess` on a batch, each of which a handler may override."""

from __future__ import annotations

import abc
import importlib
import logging
import os
import time
from typing import Any

import torch

from pipeline.stage.torchserve.ts.utils.util import list_classes_from_module, load_label_mapping

logger = logging.getLogger(__name__)


class BaseHandler(abc.ABC):  # noqa: B024 (TorchServe's class is abstract with no abstract method)
    """Loads the archive's model on its device and runs a batch through preprocess, inference and
    postprocess."""

    def __init__(self) -> None:
        self.model: Any = None
        self.mapping: Any = None
        self.device: torch.device | None = None
        self.initialized = False
        self.context: Any = None
        self.model_pt_path: str | None = None
        self.manifest: Any = None
        self.map_location: str | None = None
        self.explain = False
        self.target = 0
        self.profiler_args: dict[str, Any] = {}

    def initialize(self, context: Any) -> None:
        """Load the model: with a `modelFile` in the manifest, its one `nn.Module` class with the serialized
        file as state dict; else the serialized file as TorchScript (`.pt`). On the context's GPU where it
        names one and CUDA is there, else on the CPU."""
        self.model_yaml_config = getattr(context, "model_yaml_config", {})
        properties = context.system_properties
        gpu_id = properties.get("gpu_id")
        if torch.cuda.is_available() and gpu_id is not None:
            self.map_location = "cuda"
            self.device = torch.device(f"cuda:{gpu_id}")
        else:
            self.map_location = "cpu"
            self.device = torch.device("cpu")
        self.manifest = context.manifest
        model_dir = properties.get("model_dir")
        model = self.manifest["model"]
        self.model_pt_path = None
        if "serializedFile" in model:
            self.model_pt_path = os.path.join(model_dir, model["serializedFile"])
        model_file = model.get("modelFile", "")
        if model_file:
            self.model = self._load_pickled_model(model_dir, model_file, self.model_pt_path)
            self.model.to(self.device)
            self.model.eval()
        elif self.model_pt_path is not None and self.model_pt_path.endswith(".pt"):
            self.model = self._load_torchscript_model(self.model_pt_path)
            self.model.eval()
        else:
            raise RuntimeError(
                "No model weights could be loaded (a TorchScript .pt serialized file, or a model file with "
                "its state dict, is what BaseHandler loads here)"
            )
        self.mapping = load_label_mapping(os.path.join(model_dir, "index_to_name.json"))
        self.initialized = True

    def _load_torchscript_model(self, model_pt_path: str) -> Any:
        return torch.jit.load(model_pt_path, map_location=self.device)

    def _load_pickled_model(self, model_dir: str, model_file: str, model_pt_path: str | None) -> Any:
        """The model file's one class, made and given the serialized file's state dict."""
        if not os.path.isfile(os.path.join(model_dir, model_file)):
            raise RuntimeError("Missing the model.py file")
        module = importlib.import_module(model_file.split(".")[0])
        classes = list_classes_from_module(module)
        if len(classes) != 1:
            raise ValueError(f"Expected only one class as model definition. {classes}")
        model = classes[0]()
        if model_pt_path:
            model.load_state_dict(torch.load(model_pt_path, map_location=self.device, weights_only=True))
        return model

    def preprocess(self, data: Any) -> Any:
        return torch.as_tensor(data, device=self.device)

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            return self.model(data.to(self.device), *args, **kwargs)

    def postprocess(self, data: Any) -> Any:
        return data.tolist()

    def handle(self, data: list[dict[str, Any]], context: Any) -> Any:
        """A batch: preprocess, then inference and postprocess (or `explain_handle` where the request's
        `explain` header asks), its time recorded as `HandlerTime`."""
        started = time.time()
        self.context = context
        if self._is_describe():
            output = [self.describe_handle()]
        else:
            preprocessed = self.preprocess(data)
            if self._is_explain():
                output = self.explain_handle(preprocessed, data)
            else:
                output = self.postprocess(self.inference(preprocessed))
        if context.metrics is not None:
            context.metrics.add_time("HandlerTime", round((time.time() - started) * 1000, 2), None, "ms")
        return output

    def explain_handle(self, data_preprocess: Any, raw_data: list[dict[str, Any]]) -> Any:
        row = raw_data[0]
        inputs, target = None, 0
        if isinstance(row, dict):
            inputs = row.get("data") or row.get("body")
            target = row.get("target") or 0
        return self.get_insights(data_preprocess, inputs, target)

    def get_insights(self, tensor_data: Any, raw_data: Any, target: Any) -> Any:
        raise NotImplementedError("this handler has no get_insights: it cannot explain")

    def _is_explain(self) -> bool:
        if self.context is not None and self.context.get_request_header(0, "explain") == "True":
            self.explain = True
            return True
        return False

    def _is_describe(self) -> bool:
        return self.context is not None and self.context.get_request_header(0, "describe") == "True"

    def describe_handle(self) -> Any:
        return None
