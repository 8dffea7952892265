"""Models that call models (Triton's Business Logic Scripting), served unmodified: Python models on a real
stage service call, through a real router, another stage model, an ensemble, a failing model and a
decoupled one; an `async def execute` fans out into many `async_exec` calls that the callee gets in
batches; a model calling itself is stopped with an error, whether by the depth limit or because no
instance is free to answer it, instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_catalog
from pipeline.protocol.call_chain import MAX_DEPTH
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.telemetry import Telemetry, span_record
from pipeline.stage import triton_python_backend_utils as pb_utils
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import Running, serving_router, serving_stages
from pipeline.tools.trace_view import waterfall
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.stages import write_model

#: A model of one FP32 input X and one output Y, each [4] per item.
XY = """
name: "{name}"
backend: "python"
max_batch_size: {batch}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
{extra}
"""

#: Doubles X; batched by the router as its dynamic_batching says.
DOUBLE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)])
            for r in requests
        ]
"""

#: Calls the model its `callee` parameter names with its X, and answers the callee's Y plus one; a callee's
#: error becomes its own.
CALLER = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.callee = json.loads(args["model_config"])["parameters"]["callee"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            call = pb_utils.InferenceRequest(
                model_name=self.callee, inputs=[x], requested_output_names=["Y"], trace=request.trace()
            )
            reply = call.exec()
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=reply.error()))
                continue
            y = pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y + 1)]))
        return responses
"""

#: One `async_exec` call to its `callee` per item of its batch, all in flight at once; an item whose call
#: failed answers -1.
FAN_OUT = """
import asyncio
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.callee = json.loads(args["model_config"])["parameters"]["callee"]["string_value"]

    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            calls = [
                pb_utils.InferenceRequest(
                    model_name=self.callee, inputs=[pb_utils.Tensor("X", x[i : i + 1])], requested_output_names=["Y"]
                ).async_exec()
                for i in range(len(x))
            ]
            rows = []
            for reply in await asyncio.gather(*calls):
                if reply.has_error():
                    rows.append(np.full((1, 4), -1, np.float32))
                else:
                    rows.append(pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.concatenate(rows))]))
        return responses
"""

#: Doubles X, but refuses a batch holding a negative X.
PICKY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if (x < 0).any():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative X", pb_utils.TritonError.INVALID_ARG)))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return out
"""

#: Always fails, saying so.
FAILING = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(error=pb_utils.TritonError("broken on purpose", pb_utils.TritonError.INVALID_ARG))
            for _ in requests
        ]
"""

#: Decoupled: answers X with one response per element of X[0], each Y = X * (index + 1).
COUNTER = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            for i in range(4):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * (i + 1))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

#: Sums the responses of the decoupled `counter` (skipping an empty final one).
STREAM_SUM = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            call = pb_utils.InferenceRequest(model_name="counter", inputs=[x], requested_output_names=["Y"])
            total, seen = np.zeros_like(x.as_numpy()), 0
            for reply in call.exec(decoupled=True):
                if reply.has_error():
                    raise pb_utils.TritonModelException(reply.error().message())
                if reply.output_tensors():
                    total = total + pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()
                    seen += 1
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", total + 0 * seen)]))
        return responses
"""

#: Decoupled, and calls `double` for each of its two responses: X * 2, then X * 2 * 2.
DECOUPLED_CALLER = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(request, "X")
            for _ in range(2):
                reply = pb_utils.InferenceRequest(model_name="double", inputs=[x], requested_output_names=["Y"]).exec()
                if reply.has_error():
                    sender.send(pb_utils.InferenceResponse(error=reply.error()))
                    break
                x = pb_utils.Tensor("X", pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy())
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.as_numpy())]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

#: Calls itself with X - 1 until X[0] reaches 0 (then answers X): a recursion as deep as X[0] says.
RECURSE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] <= 0:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.copy())]))
                continue
            reply = pb_utils.InferenceRequest(
                model_name="recurse", inputs=[pb_utils.Tensor("X", x - 1)], requested_output_names=["Y"]
            ).exec()
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=reply.error()))
            else:
                responses.append(pb_utils.InferenceResponse(reply.output_tensors()))
        return responses
"""

#: What the slow models and the test tell each other: the callee started, the test lets it finish, and
#: what the caller's call answered.
SLOW: dict = {"entered": threading.Event(), "release": threading.Event(), "answered": threading.Event()}

#: Holds its request until the test releases it (at most 20 s).
HOLD_UNTIL_RELEASED = """
import numpy as np
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import SLOW

class TritonPythonModel:
    def execute(self, requests):
        SLOW["entered"].set()
        SLOW["release"].wait(20)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros((4,), np.float32))])]
"""

#: Calls `slow` and records what the call answered.
CALL_AND_RECORD = """
import numpy as np
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import SLOW

class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X")
        reply = pb_utils.InferenceRequest(model_name="slow", inputs=[x], requested_output_names=["Y"]).exec()
        SLOW["reply"] = (reply.error().code(), reply.error().message()) if reply.has_error() else None
        SLOW["answered"].set()
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("done"))]
"""

#: `call_slow` with an `async def execute`, which runs on the service's event loop.
ASYNC_CALL_AND_RECORD = """
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import SLOW

class TritonPythonModel:
    async def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X")
        reply = await pb_utils.InferenceRequest(model_name="slow", inputs=[x], requested_output_names=["Y"]).async_exec()
        SLOW["reply"] = (reply.error().code(), reply.error().message()) if reply.has_error() else None
        SLOW["answered"].set()
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("done"))]
"""

#: Stops waiting for its call to `slow` after 0.2 s (`slow` holds until the test releases it) and answers
#: -1s, noting whether the call's future was cancelled by it.
ASYNC_GIVE_UP = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import SLOW

class TritonPythonModel:
    async def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X")
        call = pb_utils.InferenceRequest(model_name="slow", inputs=[x], requested_output_names=["Y"]).async_exec()
        try:
            await asyncio.wait_for(call, 0.2)
        except asyncio.TimeoutError:
            SLOW["reply"] = call.cancelled()
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.full(4, -1, np.float32))])]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros(4, np.float32))])]
"""

#: What `ranked` ran, in order (each row's X[0]), and the gate that holds its batches.
RANKED: dict = {"order": [], "entered": threading.Event(), "release": threading.Event()}

#: Doubles X, noting the order of the rows it runs; each batch waits for the test's release (at most 20 s).
RANKED_MODEL = """
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import RANKED

class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        RANKED["order"].extend(float(row[0]) for x in xs for row in x)
        RANKED["entered"].set()
        RANKED["release"].wait(20)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]) for x in xs]
"""

#: For each batch of the models below, whether it ran on the service's event loop (the main thread here).
ON_LOOP: list[bool] = []

#: An `async def execute` that sleeps X[0] seconds without awaiting, then answers `double`'s Y.
ASYNC_SLEEPER = """
import threading
import time
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import ON_LOOP

class TritonPythonModel:
    async def execute(self, requests):
        ON_LOOP.append(threading.current_thread() is threading.main_thread())
        x = pb_utils.get_input_tensor_by_name(requests[0], "X")
        time.sleep(float(x.as_numpy().flat[0]))
        reply = await pb_utils.InferenceRequest(model_name="double", inputs=[x], requested_output_names=["Y"]).async_exec()
        return [pb_utils.InferenceResponse(reply.output_tensors())]
"""

#: An `async def execute` that calls `double` with `InferenceRequest.exec`, which waits by blocking.
ASYNC_BUT_BLOCKING = """
import threading
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import ON_LOOP

class TritonPythonModel:
    async def execute(self, requests):
        ON_LOOP.append(threading.current_thread() is threading.main_thread())
        x = pb_utils.get_input_tensor_by_name(requests[0], "X")
        reply = pb_utils.InferenceRequest(model_name="double", inputs=[x], requested_output_names=["Y"]).exec()
        return [pb_utils.InferenceResponse(reply.output_tensors())]
"""

#: The requests of `call_paired` that wait for each other before their calls (those whose X starts with 1).
PAIR = threading.Barrier(2)

#: Calls `double_late` with its X, once both its instances hold a request, when X starts with 1.
PAIRED = """
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import PAIR

class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X")
        if x.as_numpy().flat[0] == 1:
            PAIR.wait(20)
        reply = pb_utils.InferenceRequest(model_name="double_late", inputs=[x], requested_output_names=["Y"]).exec()
        return [pb_utils.InferenceResponse(reply.output_tensors())]
"""

#: Set once both instances of `self_pair` hold a request that waits for the other (`BOTH_HELD`).
BOTH_PASSED = threading.Event()
#: The requests of `self_pair` that hold both its instances at once before calling (X[1] is 1).
BOTH_HELD = threading.Barrier(2, action=BOTH_PASSED.set)

#: Calls itself with X[0] - 1 until X[0] reaches 0 (then answers X); a request whose X[1] is 1 first waits
#: until the model's two instances both hold such a request.
SELF_PAIR = """
import numpy as np
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import BOTH_HELD

class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        if x[0] <= 0:
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.copy())])]
        if x[1] == 1:
            BOTH_HELD.wait(20)
        inner = np.array([x[0] - 1, 0, 0, 0], np.float32)
        reply = pb_utils.InferenceRequest(
            model_name="self_pair", inputs=[pb_utils.Tensor("X", inner)], requested_output_names=["Y"]
        ).exec()
        if reply.has_error():
            return [pb_utils.InferenceResponse(error=reply.error())]
        return [pb_utils.InferenceResponse(reply.output_tensors())]
"""

#: What `gate` ran: each request's X[0], in order.
GATE_RAN: list[float] = []

#: Calls `slow` when X[0] is 1 (answering the call's error where it fails), and answers X.
GATE = """
import triton_python_backend_utils as pb_utils
from tests.integration.test_bls import GATE_RAN

class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X")
        GATE_RAN.append(float(x.as_numpy()[0]))
        if x.as_numpy()[0] == 1:
            reply = pb_utils.InferenceRequest(model_name="slow", inputs=[x], requested_output_names=["Y"]).exec()
            if reply.has_error():
                return [pb_utils.InferenceResponse(error=reply.error())]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.as_numpy())])]
"""

#: Batched; calls itself with X - 1 for each request whose X[0] is above 0 (then answers X).
SELF_BATCHED = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0, 0] <= 0:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.copy())]))
                continue
            reply = pb_utils.InferenceRequest(
                model_name="self_batched", inputs=[pb_utils.Tensor("X", x - 1)], requested_output_names=["Y"]
            ).exec()
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=reply.error()))
            else:
                responses.append(pb_utils.InferenceResponse(reply.output_tensors()))
        return responses
"""

#: `double` twice, as Triton's ensemble.
QUADRUPLE = """
name: "quadruple"
platform: "ensemble"
max_batch_size: 64
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "double" model_version: -1 input_map { key: "X" value: "X" } output_map { key: "Y" value: "twice" } },
    { model_name: "double" model_version: -1 input_map { key: "X" value: "twice" } output_map { key: "Y" value: "Y" } }
  ]
}
"""


def _callee(name: str) -> str:
    return f'parameters {{ key: "callee" value: {{ string_value: "{name}" }} }}'


def write_repository(root: Path) -> Path:
    batching = "dynamic_batching { max_queue_delay_microseconds: 50000 }"
    models = {
        "double": (DOUBLE, 64, 1, batching),
        "call_double": (CALLER, 8, 1, _callee("double")),
        "call_quadruple": (CALLER, 8, 1, _callee("quadruple")),
        "call_failing": (CALLER, 8, 1, _callee("failing")),
        "call_missing": (CALLER, 8, 1, _callee("no_such_model")),
        "fan_out": (FAN_OUT, 64, 1, _callee("double")),
        "fan_out_picky": (FAN_OUT, 64, 1, _callee("picky")),
        "picky": (PICKY, 64, 1, ""),
        "failing": (FAILING, 8, 1, ""),
        "counter": (COUNTER, 0, 1, "model_transaction_policy { decoupled: true }"),
        "stream_sum": (STREAM_SUM, 0, 1, ""),
        "decoupled_caller": (DECOUPLED_CALLER, 8, 1, "model_transaction_policy { decoupled: true }"),
        "recurse": (RECURSE, 0, MAX_DEPTH + 2, ""),
        "recurse_alone": (RECURSE.replace('"recurse"', '"recurse_alone"'), 0, 1, ""),
        "slow": (HOLD_UNTIL_RELEASED, 0, 1, ""),
        "call_slow": (CALL_AND_RECORD, 0, 1, ""),
        "async_call_slow": (ASYNC_CALL_AND_RECORD, 0, 1, ""),
        "async_give_up": (ASYNC_GIVE_UP, 0, 1, ""),
        "ranked": (RANKED_MODEL, 4, 1, "dynamic_batching { priority_levels: 2 default_priority_level: 2 }"),
        "call_ranked": (CALLER, 8, 1, _callee("ranked")),
        "async_sleeper": (ASYNC_SLEEPER, 8, 1, ""),
        "async_but_blocking": (ASYNC_BUT_BLOCKING, 8, 1, ""),
        "double_late": (DOUBLE, 64, 1, "dynamic_batching { max_queue_delay_microseconds: 5000000 }"),
        "call_paired": (PAIRED, 8, 2, ""),
        "self_pair": (SELF_PAIR, 0, 2, ""),
        "gate": (GATE, 0, 1, ""),
        # Every batch goes through the router's queue (none runs in its caller's task), one at a time.
        "self_batched": (
            SELF_BATCHED,
            4,
            1,
            "dynamic_batching { max_queue_delay_microseconds: 1000 }\n"
            'parameters { key: "pipeline.idle_dispatch" value: { string_value: "false" } }',
        ),
    }
    for name, (source, batch, count, extra) in models.items():
        write_model(root, name, source, XY.format(name=name, batch=batch, count=count, extra=extra))
    (root / "quadruple" / "1").mkdir(parents=True)
    (root / "quadruple" / "config.pbtxt").write_text(QUADRUPLE)
    return root


@contextlib.asynccontextmanager
async def pipeline(
    tmp_path: Path,
    *,
    stage_telemetry: Telemetry | None = None,
    router_telemetry: Telemetry | None = None,
    router_options: dict[str, object] | None = None,
    router_metrics: Metrics | None = None,
    stage_options: dict[str, object] | None = None,
    stage_metrics: Metrics | None = None,
) -> AsyncIterator[Running]:
    """The repository's Python models on a stage service, and the router; the stage finds the router's
    port in a file written once the router listens, as a launcher does."""
    root = write_repository(tmp_path / "repository")
    port_file = tmp_path / "router.port"
    options = {"router_port_file": port_file, "max_instances": MAX_DEPTH + 2, **(stage_options or {})}
    async with serving_stages(
        [],
        repository=ModelRepository(root),
        backends=[PythonBackend()],
        options=options,
        telemetry=stage_telemetry or Telemetry(),
        metrics=stage_metrics,
    ) as stage:
        await wait_serving(stage.address)
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(
            catalog, telemetry=router_telemetry or Telemetry(), options=router_options, metrics=router_metrics
        ) as router:
            port_file.write_text(router.address.rsplit(":", 1)[1])
            await wait_serving(router.address)
            yield router


def xs(*rows: float) -> np.ndarray:
    return np.array([[row] * 4 for row in rows], np.float32)


async def test_models_call_a_stage_model_an_ensemble_and_a_decoupled_model(tmp_path: Path) -> None:
    async with pipeline(tmp_path) as router, inference_stub(router.address) as stub:
        reply = await stub.ModelInfer(request_for("call_double", X=xs(1, 2)), timeout=30)
        assert response_tensors(reply)["Y"].to_array().tolist() == xs(3, 5).tolist()

        reply = await stub.ModelInfer(request_for("call_quadruple", X=xs(1, 2)), timeout=30)
        assert response_tensors(reply)["Y"].to_array().tolist() == xs(5, 9).tolist()

        x = np.array([1, 2, 3, 4], np.float32)
        reply = await stub.ModelInfer(request_for("stream_sum", X=x), timeout=30)
        # 1x + 2x + 3x + 4x of the decoupled counter's four responses.
        assert response_tensors(reply)["Y"].to_array().tolist() == (x * 10).tolist()

        # A decoupled model calls models too, while it sends its responses.
        request = request_for("decoupled_caller", X=xs(1))
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        ys = []
        async for response in stub.ModelStreamInfer(iter([request]), timeout=30):
            assert not response.error_message, response.error_message
            outputs = response_tensors(response.infer_response)
            if "Y" in outputs:
                ys.append(outputs["Y"].to_array().tolist())
            if response.infer_response.parameters["triton_final_response"].bool_param:
                break
        assert ys == [xs(2).tolist(), xs(4).tolist()]


@pytest.mark.parametrize("frames_port", [0, None], ids=["frames", "no-frame-port"])
async def test_calls_go_on_the_routers_frame_port_and_on_grpc_where_it_has_none(
    tmp_path: Path, frames_port: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    """The router names its frame port in `ServerMetadata`; the stage sends its models' calls there, with
    the same answers as over gRPC, which carries them where the router takes no frames."""
    caplog.set_level(logging.INFO, logger="pipeline.transport.server_link")
    options = {"frames_port": frames_port}
    async with pipeline(tmp_path, router_options=options) as router, inference_stub(router.address) as stub:
        metadata = await stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=10)
        named = any(e.startswith("pipeline_frames:") for e in metadata.extensions)
        assert named == (frames_port is not None)
        for _ in range(3):
            reply = await stub.ModelInfer(request_for("call_double", X=xs(1, 2)), timeout=30)
            assert response_tensors(reply)["Y"].to_array().tolist() == xs(3, 5).tolist()
        error = await rpc_error(stub.ModelInfer(request_for("call_failing", X=xs(1)), timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "broken on purpose" in (error.details() or "")
    on_frames = "calls over its frame port" in caplog.text
    assert on_frames == (frames_port is not None)


async def test_a_callees_error_reaches_the_caller_with_its_message(tmp_path: Path) -> None:
    async with pipeline(tmp_path) as router, inference_stub(router.address) as stub:
        err = await rpc_error(stub.ModelInfer(request_for("call_failing", X=xs(1)), timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "broken on purpose" in (err.details() or "")

        err = await rpc_error(stub.ModelInfer(request_for("call_missing", X=xs(1)), timeout=30))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        # Triton 2.51's words for a call to a model it does not serve (tests/parity: bls_report_missing).
        assert "Model 'no_such_model' is not ready" in (err.details() or ""), err.details()

        # The service goes on serving.
        reply = await stub.ModelInfer(request_for("call_double", X=xs(1)), timeout=30)
        assert response_tensors(reply)["Y"].to_array().tolist() == xs(3).tolist()


async def test_async_exec_fan_out_feeds_the_callees_batches(tmp_path: Path) -> None:
    async with pipeline(tmp_path) as router, inference_stub(router.address) as stub:
        rows = [float(i) for i in range(12)]
        replies = await asyncio.gather(
            *(stub.ModelInfer(request_for("fan_out", X=xs(*rows)), timeout=30) for _ in range(3))
        )
        for reply in replies:
            assert response_tensors(reply)["Y"].to_array().tolist() == xs(*(2 * r for r in rows)).tolist()
        stats = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="double"))).model_stats[0]
        # 36 calls of one item each, answered in fewer stage executions: they were batched.
        assert stats.inference_count == 36
        assert stats.execution_count < 36
        assert stats.inference_count / stats.execution_count > 1

        # Calls made together go as one request of their items; one that fails goes again call by call, so
        # each call gets its own answer.
        reply = await stub.ModelInfer(request_for("fan_out_picky", X=xs(1, -2, 3)), timeout=30)
        assert response_tensors(reply)["Y"].to_array().tolist() == xs(2, -1, 6).tolist()
        stats = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="picky"))).model_stats[0]
        assert (stats.inference_stats.success.count, stats.inference_stats.fail.count) == (2, 2)


async def test_a_batched_callee_waits_for_the_calls_of_requests_on_their_way(tmp_path: Path) -> None:
    async with pipeline(tmp_path) as router, inference_stub(router.address) as stub:
        # A first request teaches the router that call_paired calls double_late; alone, its call goes at once
        # (the callee's delay is 5 s).
        reply = await stub.ModelInfer(request_for("call_paired", X=xs(0)), timeout=30)
        assert response_tensors(reply)["Y"].to_array().tolist() == xs(0).tolist()

        # Two requests held by the stage at once: each is announced to double_late's batcher while it runs,
        # so the first call waits for the second (batch_upcoming) and the two go as one batch. Unannounced,
        # the first would go alone at once, the idle stage taking what is queued.
        PAIR.reset()
        replies = await asyncio.gather(
            *(stub.ModelInfer(request_for("call_paired", X=xs(1)), timeout=30) for _ in range(2))
        )
        for reply in replies:
            assert response_tensors(reply)["Y"].to_array().tolist() == xs(2).tolist()
        stats = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="double_late"))).model_stats[0]
        assert (stats.inference_count, stats.execution_count) == (3, 2)


async def test_recursion_is_bounded_by_depth_and_by_free_instances(tmp_path: Path) -> None:
    async with pipeline(tmp_path) as router, inference_stub(router.address) as stub:
        # Within the limit, a model calling itself completes.
        reply = await stub.ModelInfer(
            request_for("recurse", X=np.array([3, 0, 0, 0], np.float32)), timeout=30
        )
        assert response_tensors(reply)["Y"].to_array().tolist() == [0, -3, -3, -3]

        # Past it, the call that would go deeper is refused, and the error climbs back up the chain.
        deep = np.array([MAX_DEPTH + 1, 0, 0, 0], np.float32)
        err = await rpc_error(stub.ModelInfer(request_for("recurse", X=deep), timeout=30))
        assert f"more than the {MAX_DEPTH} allowed" in (err.details() or "")

        # One instance, calling its own model: no instance could run the call. Refused at once (no deadline
        # set: it would wait forever), where Triton's Python backend hangs.
        one = np.array([1, 0, 0, 0], np.float32)
        err = await rpc_error(stub.ModelInfer(request_for("recurse_alone", X=one)))
        assert "every instance (1) is waiting for this call" in (err.details() or "")


async def test_a_model_whose_every_instance_waits_on_its_own_calls_refuses_one_and_serves_on(
    tmp_path: Path,
) -> None:
    """More callers at once than the model has instances, each of its two instances held by a request that
    calls the model: neither call could ever run. The call that closes the circle is refused at once,
    naming the model; its caller answers that error, which frees an instance for the other call (a call the
    model's own requests wait on goes ahead of a client's request), and the third caller is served after."""
    held, plain = np.array([1, 1, 0, 0], np.float32), np.array([1, 0, 0, 0], np.float32)
    BOTH_HELD.reset()
    BOTH_PASSED.clear()
    async with pipeline(tmp_path) as router, inference_stub(router.address) as stub:
        calls = [asyncio.ensure_future(stub.ModelInfer(request_for("self_pair", X=held))) for _ in range(2)]
        # Both instances hold a request before the third comes (it would take an instance first).
        assert await asyncio.to_thread(BOTH_PASSED.wait, 20)
        calls.append(asyncio.ensure_future(stub.ModelInfer(request_for("self_pair", X=plain))))
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
        refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        assert len(refused) == 1, outcomes
        assert refused[0].code() == grpc.StatusCode.UNAVAILABLE
        details = refused[0].details() or ""
        assert "model 'self_pair'" in details and "every instance (2) is waiting" in details, details
        for outcome in outcomes:
            if not isinstance(outcome, BaseException):
                assert response_tensors(outcome)["Y"].to_array().tolist() == [0.0] * 4
        # The model serves on: a call that finds an instance free is never refused.
        for _ in range(2):
            reply = await stub.ModelInfer(request_for("self_pair", X=plain), timeout=30)
            assert response_tensors(reply)["Y"].to_array().tolist() == [0.0] * 4


async def until(condition: Callable[[], bool]) -> None:
    """Wait until `condition` holds (polled; at most 10 s, less than the test models hold a request)."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the condition did not come true in 10 s")


@contextlib.asynccontextmanager
async def slow_calls() -> AsyncIterator[None]:
    for event in ("entered", "release", "answered"):
        SLOW[event].clear()
    SLOW.pop("reply", None)
    try:
        yield
    finally:
        SLOW["release"].set()


@pytest.mark.parametrize("caller", ["call_slow", "async_call_slow"])
async def test_cancelling_the_outer_request_cancels_its_calls(tmp_path: Path, caller: str) -> None:
    async with pipeline(tmp_path) as router, slow_calls(), inference_stub(router.address) as stub:
        # Metadata of the client's own: the router's call to the caller's stage is a gRPC call of its own,
        # which carries the cancellation (its frame port carries none).
        call = stub.ModelInfer(request_for(caller, X=np.ones(4, np.float32)), metadata=(("x-test", "1"),))
        assert await asyncio.to_thread(SLOW["entered"].wait, 20)
        call.cancel()
        # The caller's call to `slow` is cancelled with it: it answers at once, while `slow` still holds.
        assert await asyncio.to_thread(SLOW["answered"].wait, 20)
        assert not SLOW["release"].is_set()
        code, message = SLOW["reply"]
        assert code == pb_utils.TritonError.CANCELLED, message


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "streams"])
async def test_when_its_callers_leave_a_held_model_serves_again(tmp_path: Path, frames: bool) -> None:
    """The calls whose callers went away are cancelled down the chain, on the frame connections and on the
    shared streams alike (between router and stage, both ways): `gate` is held by a request waiting on
    `slow`, and another request waits for its instance. Their clients leave (no deadline: nothing else would
    end them); the waiting request is dropped unrun, the held one's call to `slow` answers CANCELLED, and
    `gate` serves the next request while `slow` still holds."""
    options: dict[str, object] = {"frames_port": 0 if frames else None}
    metrics = Metrics()

    def queued() -> float:
        return metrics.registry.get_sample_value("pipeline_queue_depth", {"model": "gate"}) or 0.0

    GATE_RAN.clear()
    async with (
        pipeline(tmp_path, router_options=options, stage_options=options, stage_metrics=metrics) as router,
        slow_calls(),
        inference_stub(router.address) as stub,
    ):
        held = stub.ModelInfer(request_for("gate", X=np.ones(4, np.float32)))
        assert await asyncio.to_thread(SLOW["entered"].wait, 20)
        waiting = stub.ModelInfer(request_for("gate", X=np.full(4, 2, np.float32)))
        await until(lambda: queued() == 1)
        waiting.cancel()
        await until(lambda: queued() == 0)
        held.cancel()
        reply = await stub.ModelInfer(request_for("gate", X=np.full(4, 3, np.float32)), timeout=10)
        assert response_tensors(reply)["Y"].to_array().tolist() == [3.0] * 4
        assert not SLOW["release"].is_set()
        assert GATE_RAN == [1.0, 3.0]


async def test_a_batched_model_held_by_its_call_to_itself_serves_again_when_its_caller_leaves(
    tmp_path: Path,
) -> None:
    """A batched model calling itself: its call waits in the router's queue of the model, behind the one
    batch in flight that waits on it, where no stage sees it (nothing refuses it). When the caller leaves,
    the batch none of whose requests is waited for has its stage call cancelled, the model's call with it,
    and the model serves again."""
    frames = {"frames_port": 0}
    router_metrics, stage_metrics = Metrics(), Metrics()

    def queued_at_router() -> float:
        return (
            router_metrics.registry.get_sample_value("pipeline_queue_depth", {"model": "self_batched"}) or 0.0
        )

    def running_on_stage() -> float:
        sample = stage_metrics.registry.get_sample_value
        return sample("pipeline_inflight_batches", {"model": "self_batched"}) or 0.0

    async with (
        pipeline(
            tmp_path,
            router_options=frames,
            stage_options=frames,
            router_metrics=router_metrics,
            stage_metrics=stage_metrics,
        ) as router,
        inference_stub(router.address) as stub,
    ):
        held = stub.ModelInfer(request_for("self_batched", X=xs(1)))  # no deadline: nothing else ends it
        await until(lambda: running_on_stage() == 1 and queued_at_router() == 1)
        held.cancel()
        reply = await stub.ModelInfer(request_for("self_batched", X=xs(0)), timeout=10)
        assert response_tensors(reply)["Y"].to_array().tolist() == xs(0).tolist()
        assert running_on_stage() == 0


async def test_a_model_that_stops_waiting_for_its_call_goes_on(tmp_path: Path) -> None:
    async with pipeline(tmp_path) as router, slow_calls(), inference_stub(router.address) as stub:
        reply = await stub.ModelInfer(request_for("async_give_up", X=np.ones(4, np.float32)), timeout=30)
        assert response_tensors(reply)["Y"].to_array().tolist() == [-1.0] * 4
        assert SLOW["reply"] is True  # its call's future was cancelled, not left pending
        assert SLOW["entered"].is_set()
        SLOW["release"].set()  # the abandoned call's answer comes, and is dropped
        for _ in range(2):
            reply = await stub.ModelInfer(request_for("call_double", X=xs(1.0)), timeout=30)
            assert response_tensors(reply)["Y"].to_array().tolist() == xs(3.0).tolist()


async def test_a_call_inherits_the_priority_its_request_asked_for(tmp_path: Path) -> None:
    metrics = Metrics()

    def queued() -> float:
        return metrics.registry.get_sample_value("pipeline_queue_depth", {"model": "ranked"}) or 0.0

    RANKED["order"].clear()
    RANKED["entered"].clear()
    RANKED["release"].clear()
    async with pipeline(tmp_path, router_metrics=metrics) as router, inference_stub(router.address) as stub:
        try:
            # `ranked` runs one batch at a time: the first holds it while the next two queue at the router.
            first = asyncio.ensure_future(stub.ModelInfer(request_for("ranked", X=xs(0.0)), timeout=30))
            assert await asyncio.to_thread(RANKED["entered"].wait, 20)
            low = asyncio.ensure_future(stub.ModelInfer(request_for("ranked", X=xs(1.0)), timeout=30))
            # `call_ranked` is not batched, so its request's priority only travels: its call of `ranked`
            # queues at priority 1 (`ranked` has two levels, 2 by default).
            request = request_for("call_ranked", X=xs(2.0))
            request.parameters["priority"].int64_param = 1
            high = asyncio.ensure_future(stub.ModelInfer(request, timeout=30))
            for _ in range(400):  # until both wait in the router's queue of `ranked`
                if queued() == 2:
                    break
                await asyncio.sleep(0.05)
            assert queued() == 2
        finally:
            RANKED["release"].set()
        replies = await asyncio.gather(first, low, high)
    assert RANKED["order"] == [0.0, 2.0, 1.0]  # the call went first, ahead of the earlier request
    assert response_tensors(replies[2])["Y"].to_array().tolist() == xs(5.0).tolist()


async def test_an_async_execute_runs_on_the_services_loop_unless_it_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with pipeline(tmp_path) as router, inference_stub(router.address) as stub:
        ON_LOOP.clear()
        # On the service's loop while it awaits its calls; once it has held the loop 0.2 s without awaiting,
        # its later batches run on its instance's thread.
        for seconds in (0.0, 0.2, 0.0):
            reply = await stub.ModelInfer(request_for("async_sleeper", X=xs(seconds)), timeout=30)
            assert response_tensors(reply)["Y"].to_array().tolist() == xs(2 * seconds).tolist()
        assert ON_LOOP == [True, True, False]
        assert "held the service's event loop for" in caplog.text

        # A model whose code calls InferenceRequest.exec, which waits by blocking, runs on its thread from the start.
        ON_LOOP.clear()
        reply = await stub.ModelInfer(request_for("async_but_blocking", X=xs(1)), timeout=30)
        assert response_tensors(reply)["Y"].to_array().tolist() == xs(2).tolist()
        assert ON_LOOP == [False]


async def test_a_call_has_what_is_left_of_the_callers_deadline(tmp_path: Path) -> None:
    async with pipeline(tmp_path) as router, slow_calls(), inference_stub(router.address) as stub:
        err = await rpc_error(
            stub.ModelInfer(request_for("call_slow", X=np.ones(4, np.float32)), timeout=1.0)
        )
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await asyncio.to_thread(SLOW["answered"].wait, 20)
        assert not SLOW["release"].is_set()
        code, message = SLOW["reply"]
        # A call whose time ran out: UNAVAILABLE, as Triton answers a request whose timeout expired.
        assert code == pb_utils.TritonError.UNAVAILABLE and "deadline" in message.lower(), message


def _traced(service: str) -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Telemetry(provider), exporter


async def test_a_call_is_traced_under_its_caller(tmp_path: Path) -> None:
    stage_telemetry, stage_spans = _traced("stage")
    router_telemetry, router_spans = _traced("router")
    async with (
        pipeline(tmp_path, stage_telemetry=stage_telemetry, router_telemetry=router_telemetry) as router,
        inference_stub(router.address) as stub,
    ):
        await stub.ModelInfer(request_for("call_double", X=xs(1)), timeout=30)
    stage = [s for s in stage_spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    routed = [s for s in router_spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    caller = next(s for s in stage if "call_double" in s.name)
    call = next(s for s in routed if s.name.endswith(" double"))
    callee = next(s for s in stage if s.name.endswith(" double"))
    # One trace: the router's span of the call is a child of the caller's span on the stage, and the
    # callee's stage span sits under it.
    assert call.parent is not None and call.parent.span_id == caller.context.span_id
    assert {caller.context.trace_id, call.context.trace_id, callee.context.trace_id} == {
        caller.context.trace_id
    }

    # `pipeline trace` draws the call under its caller.
    records = [
        span_record(s) for s in (*stage_spans.get_finished_spans(), *router_spans.get_finished_spans())
    ]
    rows = waterfall(records, f"{caller.context.trace_id:032x}")
    ids = [row.span["span_id"] for row in rows]
    at, below = ids.index(f"{caller.context.span_id:016x}"), ids.index(f"{call.context.span_id:016x}")
    assert below > at and all(row.depth > rows[at].depth for row in rows[at + 1 : below + 1])
