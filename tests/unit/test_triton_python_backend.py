"""Triton's Python-backend API as its documentation shows it: the logger, `auto_complete_config` and
`pb_utils.ModelConfig`, the config and type helpers, error codes, async `execute`, request cancellation, and
what is refused (BLS, the model loading API) with a message saying so."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import DeadlineExceeded, InvalidInput, RepositoryError, StageError, Unavailable
from pipeline.runtime.repository import ModelRepository
from pipeline.stage import triton_python_backend_utils as pb_utils
from pipeline.stage.api import Deadline
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.triton_model import model_error
from tests.stages import write_model

#: A model as Triton's documentation writes one: it logs with `pb_utils.Logger`, completes its own config
#: (there is no config.pbtxt), reads it back with the helpers, and checks for cancellation.
DOCUMENTED = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}]
        outputs = [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]
        config = auto_complete_model_config.as_dict()
        names = [tensor["name"] for tensor in config["input"]]
        for tensor in inputs:
            if tensor["name"] not in names:
                auto_complete_model_config.add_input(tensor)
        for tensor in outputs:
            auto_complete_model_config.add_output(tensor)
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        output = pb_utils.get_output_config_by_name(self.model_config, "OUTPUT0")
        self.dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        logger = pb_utils.Logger
        logger.log_info(f"initialized {args['model_name']} (decoupled: {self.decoupled})")
        logger.log_warn("a warning")
        logger.log_error("an error")
        logger.log_verbose("a verbose line")
        logger.log("explicitly at WARNING", logger.WARNING)
        logger.log("no level given")

    def execute(self, requests):
        responses = []
        for request in requests:
            if request.is_cancelled():
                error = pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", (x * 2).astype(self.dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out], parameters={"doubled": True}))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("finalized")
"""


def _prepared(root: Path, name: str):
    entry = ModelRepository(root).read(name)
    return PythonBackend().prepare(entry, entry.served_versions()[-1])


def test_a_documented_model_completes_its_config_logs_and_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_model(tmp_path, "doubler", DOCUMENTED)
    prepared = _prepared(tmp_path, "doubler")
    config = prepared.config
    assert config.max_batch_size == 8 and config.HasField("dynamic_batching")
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("INPUT0", mc.TYPE_FP32, [4])]
    assert [t.name for t in config.output] == ["OUTPUT0"]
    [instance] = prepared.instances
    with caplog.at_level(logging.DEBUG, logger="triton_python_backend_utils"):
        instance.load()
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(instance.run({"INPUT0": x})["OUTPUT0"], x * 2)
        instance.unload()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "triton_python_backend_utils"]
    assert lines == [
        (logging.INFO, "initialized doubler (decoupled: False)"),
        (logging.WARNING, "a warning"),
        (logging.ERROR, "an error"),
        (logging.DEBUG, "a verbose line"),
        (logging.WARNING, "explicitly at WARNING"),
        (logging.INFO, "no level given"),
        (logging.INFO, "finalized"),
    ]
    assert {r.pathname for r in caplog.records if r.name == "triton_python_backend_utils"} == {str(path)}


def test_a_request_past_its_deadline_is_cancelled_for_the_model(tmp_path: Path) -> None:
    write_model(tmp_path, "doubler", DOCUMENTED)
    [instance] = _prepared(tmp_path, "doubler").instances
    instance.load()
    passed = Deadline(at=0.0, clock=lambda: 1.0)
    with pytest.raises(DeadlineExceeded, match="cancelled"):
        instance.run({"INPUT0": np.ones((1, 4), np.float32)}, passed)
    instance.unload()


def test_auto_complete_may_complete_the_config_but_not_contradict_it(tmp_path: Path) -> None:
    config = (
        'backend: "python"\nmax_batch_size: 16\ninput { name: "INPUT0" data_type: TYPE_INT32 dims: [4] }\n'
    )
    path = write_model(tmp_path, "doubler", DOCUMENTED, config)
    with pytest.raises(RepositoryError) as caught:
        _prepared(tmp_path, "doubler")
    assert str(path) in caught.value.message and "auto_complete_config failed" in caught.value.message
    assert "max_batch_size 16, more than the 8" in caught.value.message

    given = pb_utils.ModelConfig(
        json.dumps({"name": "m", "input": [{"name": "X", "data_type": "TYPE_FP32"}]})
    )
    with pytest.raises(ValueError, match="the config declares TYPE_FP32, auto_complete_config TYPE_INT8"):
        given.add_input({"name": "X", "data_type": "TYPE_INT8", "dims": [1]})
    with pytest.raises(ValueError, match="sets shape"):
        given.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [1], "shape": [1]})
    given.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [3], "optional": True})
    assert given.as_dict()["input"] == [
        {"name": "X", "data_type": "TYPE_FP32", "dims": [3], "optional": True}
    ]
    given.set_model_transaction_policy({"decoupled": False})
    with pytest.raises(ValueError, match="sets decoupled False"):
        given.set_model_transaction_policy({"decoupled": True})
    with pytest.raises(ValueError, match="sets sequence_batching"):
        pb_utils.ModelConfig({"name": "m", "sequence_batching": {}}).set_dynamic_batching()


def test_auto_complete_may_make_a_model_decoupled(tmp_path: Path) -> None:
    source = DOCUMENTED.replace(
        "        auto_complete_model_config.set_dynamic_batching()\n",
        '        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})\n',
    )
    write_model(tmp_path, "doubler", source)
    assert _prepared(tmp_path, "doubler").config.model_transaction_policy.decoupled


def test_a_model_that_is_not_decoupled_has_no_response_sender() -> None:
    request = pb_utils.InferenceRequest(model_name="m")
    with pytest.raises(pb_utils.TritonModelException, match="is not decoupled"):
        request.get_response_sender()


def test_an_async_execute_runs(tmp_path: Path) -> None:
    source = DOCUMENTED.replace("    def execute(self, requests):", "    async def execute(self, requests):")
    write_model(tmp_path, "doubler", source)
    [instance] = _prepared(tmp_path, "doubler").instances
    instance.load()
    np.testing.assert_array_equal(instance.run({"INPUT0": np.ones((1, 4), np.float32)})["OUTPUT0"], 2)
    instance.unload()


def test_each_error_code_has_its_status() -> None:
    error = pb_utils.TritonError
    assert isinstance(model_error(error("bad", error.INVALID_ARG)), InvalidInput)
    assert isinstance(model_error(error("later", error.UNAVAILABLE)), Unavailable)
    for code, status in (
        (error.INTERNAL, grpc.StatusCode.INTERNAL),
        (error.UNKNOWN, grpc.StatusCode.UNKNOWN),
        (error.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
        (error.UNSUPPORTED, grpc.StatusCode.UNIMPLEMENTED),
        (error.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS),
        (error.CANCELLED, grpc.StatusCode.CANCELLED),
    ):
        answered = model_error(error("why", code))
        assert isinstance(answered, StageError) and (answered.code, answered.message) == (status, "why")
    assert error("default").code() == error.INTERNAL
    assert [error.UNKNOWN, error.INTERNAL, error.NOT_FOUND, error.INVALID_ARG, error.CANCELLED] == [
        0,
        1,
        2,
        3,
        7,
    ]


def test_type_helpers_and_constants() -> None:
    assert pb_utils.triton_to_numpy_type(mc.TYPE_FP32) is np.float32
    assert pb_utils.triton_to_numpy_type(mc.TYPE_STRING) is np.object_
    assert pb_utils.triton_to_numpy_type(0) is None
    assert pb_utils.numpy_to_triton_type(np.int64) == mc.TYPE_INT64
    assert pb_utils.numpy_to_triton_type(np.object_) == mc.TYPE_STRING
    assert pb_utils.Tensor("T", np.zeros(2, np.uint8)).triton_dtype() == mc.TYPE_UINT8
    assert pb_utils.TRITON_STRING_TO_NUMPY["TYPE_FP16"] is np.float16
    assert pb_utils.TRITON_STRING_TO_NUMPY["TYPE_STRING"] is np.object_
    strings = np.array([[b"ab", "é"], [b"", b"xyz"]], dtype=object)
    encoded = pb_utils.serialize_byte_tensor(strings)
    assert encoded[:6] == b"\x02\x00\x00\x00ab"
    assert pb_utils.deserialize_bytes_tensor(encoded).tolist() == [b"ab", "é".encode(), b"", b"xyz"]
    assert pb_utils.using_decoupled_model_transaction_policy(
        {"model_transaction_policy": {"decoupled": True}}
    )
    assert not pb_utils.using_decoupled_model_transaction_policy({})
    assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1
    assert (
        pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
        == 3
    )
    assert pb_utils.Logger.LogLevel.ERROR == pb_utils.Logger.ERROR
    response = pb_utils.InferenceResponse(parameters={"k": 1})
    assert json.loads(response.parameters()) == {"k": 1}


def test_calls_outside_a_request_and_model_loading_are_refused_saying_why() -> None:
    request = pb_utils.InferenceRequest(model_name="other", inputs=[], requested_output_names=[])
    response = request.exec()
    assert response.has_error() and response.error().code() == pb_utils.TritonError.UNSUPPORTED
    assert "only while the service runs a request" in response.error().message()
    [streamed] = list(request.exec(decoupled=True))
    assert streamed.has_error()
    for call in (pb_utils.is_model_ready, pb_utils.load_model, pb_utils.unload_model):
        with pytest.raises(pb_utils.TritonModelException, match="model loading API is not supported"):
            call("other")
    with pytest.raises(pb_utils.TritonModelException, match="rescheduling"):
        request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
