"""Sequence batching (Triton's `sequence_batching`) on a stage service: a python model's control inputs and
implicit state, the direct and oldest strategies, and Triton's refusals, through tritonclient as Triton's
users call it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.stages import write_model

#: A Triton Python model that adds its input to the sequence's running total, kept in Triton's implicit
#: state; every control input comes back as an output, so a test sees what the model saw.
ACCUMULATOR = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            def get(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            total = get("STATE") + get("INPUT") * get("READY").astype(np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", total),
                pb_utils.Tensor("STATE_OUT", total),
                pb_utils.Tensor("STARTED", get("START").astype(np.int32)),
                pb_utils.Tensor("ENDED", get("END").astype(np.int32)),
                pb_utils.Tensor("CORRID_OUT", get("CORRID").astype(np.int64)),
                pb_utils.Tensor("FLAGS", np.array([[request.flags()]], np.int32)),
                pb_utils.Tensor("BATCH", np.array([[len(requests)]], np.int32)),
            ]))
        return responses
"""

CONFIG = """
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "STARTED" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "ENDED" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "CORRID_OUT" data_type: TYPE_INT64 dims: [ 1 ] }},
  {{ name: "FLAGS" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }}
]
sequence_batching {{
  {strategy}
  max_sequence_idle_microseconds: {idle}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
  state [ {{
    input_name: "STATE" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ]
    initial_state {{ data_type: TYPE_INT32 dims: [ 1 ] {initial} name: "zero" }}
  }} ]
}}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

OLDEST = (
    "oldest { max_candidate_sequences: 8 max_queue_delay_microseconds: 200000 preferred_batch_size: [ 4 ] }"
)
DIRECT = "direct { }"


def accumulator(
    root: Path, strategy: str = OLDEST, idle: int = 600_000_000, initial: str = "zero_data: true"
) -> None:
    write_model(root, "accumulate", ACCUMULATOR, CONFIG.format(strategy=strategy, idle=idle, initial=initial))


def serving(root: Path):
    return serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()])


def sequence_request(
    value: int, sequence_id: int | str, *, start: bool = False, end: bool = False, model: str = "accumulate"
) -> pb.ModelInferRequest:
    """A request of a sequence, with the parameters Triton's clients give it."""
    request = request_for(model, INPUT=np.array([[value]], np.int32))
    if isinstance(sequence_id, str):
        request.parameters["sequence_id"].string_param = sequence_id
    else:
        request.parameters["sequence_id"].int64_param = sequence_id
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    return request


async def send(
    stub: pb_grpc.GRPCInferenceServiceStub,
    value: int,
    sequence_id: int | str,
    *,
    start: bool = False,
    end: bool = False,
    model: str = "accumulate",
) -> dict[str, int]:
    reply = await stub.ModelInfer(
        sequence_request(value, sequence_id, start=start, end=end, model=model), timeout=30
    )
    return {name: int(tensor.to_array()[0, 0]) for name, tensor in response_tensors(reply).items()}


async def test_interleaved_sequences_keep_their_own_state_and_see_their_controls(tmp_path: Path) -> None:
    accumulator(tmp_path)
    async with serving(tmp_path) as stage, inference_stub(stage.address) as client:
        await wait_serving(stage.address, timeout=60)
        first = await send(client, 1, 11, start=True)
        assert first == {"OUTPUT": 1, "STARTED": 1, "ENDED": 0, "CORRID_OUT": 11, "FLAGS": 1, "BATCH": 1}
        other = await send(client, 100, 22, start=True)
        assert other["OUTPUT"] == 100
        assert (await send(client, 2, 11))["OUTPUT"] == 3
        assert (await send(client, 200, 22))["OUTPUT"] == 300
        last = await send(client, 3, 11, end=True)
        assert last == {"OUTPUT": 6, "STARTED": 0, "ENDED": 1, "CORRID_OUT": 11, "FLAGS": 2, "BATCH": 1}
        # Sequence 11 has ended: a request without START is refused, as Triton refuses it.
        refused = await rpc_error(client.ModelInfer(sequence_request(4, 11)))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.details() == (
            "inference request for sequence 11 to model 'accumulate' must specify the START flag on the first "
            "request of the sequence"
        )
        # The same id starts afresh; the other sequence carries on.
        assert (await send(client, 5, 11, start=True, end=True))["OUTPUT"] == 5
        assert (await send(client, 300, 22, end=True))["OUTPUT"] == 600


async def test_concurrent_sequences_share_batches_with_the_oldest_strategy(tmp_path: Path) -> None:
    accumulator(tmp_path)
    async with serving(tmp_path) as stage, inference_stub(stage.address) as client:
        await wait_serving(stage.address, timeout=60)

        async def run(sequence: int) -> tuple[list[int], list[int]]:
            totals, batches = [], []
            for step in range(5):
                reply = await send(client, sequence * step, 100 + sequence, start=step == 0, end=step == 4)
                totals.append(reply["OUTPUT"])
                batches.append(reply["BATCH"])
            return totals, batches

        results = await asyncio.gather(*(run(n) for n in range(1, 5)))
        stats = await client.ModelStatistics(pb.ModelStatisticsRequest(name="accumulate"))
    for n, (totals, _) in enumerate(results, start=1):
        assert totals == [n * sum(range(k + 1)) for k in range(5)]
    # Four sequences, a preferred size of four and a long delay: the model ran every step as one batch.
    assert {size for _, batches in results for size in batches} == {4}
    model = stats.model_stats[0]
    assert (model.inference_count, model.execution_count) == (20, 5)


async def test_a_string_sequence_id_reaches_a_string_corrid_and_the_direct_strategy_pads_free_slots(
    tmp_path: Path,
) -> None:
    config = CONFIG.format(strategy=DIRECT, idle=600_000_000, initial="zero_data: true").replace(
        "data_type: TYPE_UINT64", "data_type: TYPE_STRING"
    )
    source = ACCUMULATOR.replace(
        'get("CORRID").astype(np.int64)', "np.array([[len(get('CORRID')[0, 0])]], np.int64)"
    )
    write_model(tmp_path, "accumulate", source, config)
    async with serving(tmp_path) as stage, inference_stub(stage.address) as client:
        await wait_serving(stage.address, timeout=60)
        reply = await send(client, 7, "session-abc", start=True)
        assert reply["OUTPUT"] == 7 and reply["CORRID_OUT"] == len("session-abc")
        assert (await send(client, 1, "session-abc", end=True))["OUTPUT"] == 8


async def test_an_idle_sequence_is_released_and_its_next_request_refused(tmp_path: Path) -> None:
    accumulator(tmp_path, idle=200_000)
    async with serving(tmp_path) as stage, inference_stub(stage.address) as client:
        await wait_serving(stage.address, timeout=60)
        await send(client, 1, 5, start=True)
        await asyncio.sleep(0.6)  # longer than max_sequence_idle_microseconds: the sequence is released
        refused = await rpc_error(client.ModelInfer(sequence_request(1, 5)))
        assert "must specify the START flag on the first request of the sequence" in refused.details()


async def test_initial_state_from_a_data_file(tmp_path: Path) -> None:
    accumulator(tmp_path, initial='data_file: "start.bin"')
    (tmp_path / "accumulate" / "initial_state").mkdir()
    (tmp_path / "accumulate" / "initial_state" / "start.bin").write_bytes(
        np.array([1000], np.int32).tobytes()
    )
    async with serving(tmp_path) as stage, inference_stub(stage.address) as client:
        await wait_serving(stage.address, timeout=60)
        assert (await send(client, 1, 9, start=True))["OUTPUT"] == 1001
        assert (await send(client, 2, 9, end=True))["OUTPUT"] == 1003


async def test_requests_without_a_sequence_or_with_a_batch_are_refused_as_triton_refuses_them(
    tmp_path: Path,
) -> None:
    accumulator(tmp_path)
    async with serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=60)
        error = await rpc_error(stub.ModelInfer(request_for("accumulate", INPUT=np.array([[1]], np.int32))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == (
            "inference request to model 'accumulate' must specify a non-zero or non-empty correlation ID"
        )
        request = request_for("accumulate", INPUT=np.array([[1], [2]], np.int32))
        request.parameters["sequence_id"].int64_param = 3
        request.parameters["sequence_start"].bool_param = True
        error = await rpc_error(stub.ModelInfer(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must specify batch-size 1 due to requirements of sequence batcher" in error.details()
        request = request_for("accumulate", INPUT=np.array([[1]], np.int32))
        request.parameters["sequence_id"].string_param = "text"
        request.parameters["sequence_start"].bool_param = True
        error = await rpc_error(stub.ModelInfer(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sequence id 'text' is a string" in error.details() and "UINT64" in error.details()


# ---- ONNX models on the model service ----------------------------------------------------------------------------

ONNX_CONFIG = """
name: "running_sum"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
sequence_batching {
  oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 100000 preferred_batch_size: [ 3 ] }
  max_sequence_idle_microseconds: 600000000
  control_input [ { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] } ]
  state [ {
    input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 2 ]
    initial_state { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true name: "zeros" }
  } ]
}
"""


def write_running_sum(path: Path) -> None:
    """An ONNX model keeping a running sum in Triton's implicit state: STATE_OUT = STATE_IN + X * READY,
    Y = STATE_OUT * 2."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["X", "READY"], ["XR"]),
            helper.make_node("Add", ["STATE_IN", "XR"], ["STATE_OUT"]),
            helper.make_node("Add", ["STATE_OUT", "STATE_OUT"], ["Y"]),
        ],
        "running_sum",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2]),
            helper.make_tensor_value_info("READY", TensorProto.FLOAT, ["N", 1]),
            helper.make_tensor_value_info("STATE_IN", TensorProto.FLOAT, ["N", 2]),
        ],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2]),
            helper.make_tensor_value_info("STATE_OUT", TensorProto.FLOAT, ["N", 2]),
        ],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def serving_models(root: Path):
    from services.model.backend import ModelBackend

    return serving_stages(
        [], repository=ModelRepository(root), backends=[ModelBackend(Runners(device="cpu"))]
    )


async def test_an_onnx_model_keeps_its_state_per_sequence_in_shared_batches(tmp_path: Path) -> None:
    write_running_sum(tmp_path / "running_sum" / "1" / "model.onnx")
    (tmp_path / "running_sum" / "config.pbtxt").write_text(ONNX_CONFIG)
    async with serving_models(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=120)
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="running_sum"))).config
        assert [t.name for t in config.input] == ["X"] and [t.name for t in config.output] == ["Y"]

        async def run(sequence: int) -> list[list[float]]:
            seen = []
            for step in range(4):
                request = request_for("running_sum", X=np.array([[sequence, step]], np.float32))
                request.parameters["sequence_id"].int64_param = sequence
                request.parameters["sequence_start"].bool_param = step == 0
                request.parameters["sequence_end"].bool_param = step == 3
                reply = await stub.ModelInfer(request, timeout=30)
                seen.append(response_tensors(reply)["Y"].to_array()[0].tolist())
            return seen

        results = await asyncio.gather(*(run(n) for n in (1, 2, 3)))
        stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="running_sum"))
    for sequence, seen in zip((1, 2, 3), results, strict=True):
        assert seen == [[2.0 * sequence * (k + 1), 2.0 * sum(range(k + 1))] for k in range(4)]
    model = stats.model_stats[0]
    assert (model.inference_count, model.execution_count) == (12, 4)


async def test_an_onnx_model_without_the_control_input_its_config_names_is_refused(tmp_path: Path) -> None:
    write_running_sum(tmp_path / "running_sum" / "1" / "model.onnx")
    config = ONNX_CONFIG.replace('name: "READY"', 'name: "GO"')
    (tmp_path / "running_sum" / "config.pbtxt").write_text(config)
    async with serving_models(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=120)
        reply = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        (model,) = reply.models
        assert model.state == "UNAVAILABLE"
        assert "'GO'" in model.reason and "READY" in model.reason, model.reason
