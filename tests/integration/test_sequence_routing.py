"""The router keeps a sequence with its state: every request of a sequence reaches the replica of the stage that
holds it, directly and through an ensemble, and a replica that goes away takes only its own sequences with it."""

from __future__ import annotations

import asyncio
import json
import sys
from asyncio.subprocess import PIPE
from pathlib import Path

import aiohttp
import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.cli import main
from pipeline.ensemble.catalog import load_catalog, load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.router.stages.replicas import rendezvous
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.model_statistics import add_statistics
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.integration.test_sequences import ACCUMULATOR, CONFIG, OLDEST
from tests.stages import write_model

#: Room on one replica for every sequence of a test (a sequence past its slots waits for one to end).
CANDIDATES = "oldest { max_candidate_sequences: 16 max_queue_delay_microseconds: 2000 }"

ENSEMBLE = """
name: "running_total"
platform: "ensemble"
max_batch_size: 8
input [ { name: "VALUE" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOTAL" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [ {
  model_name: "accumulate" model_version: -1
  input_map { key: "INPUT" value: "VALUE" }
  output_map { key: "OUTPUT" value: "TOTAL" }
} ] }
"""


def repository(root: Path) -> Path:
    write_model(
        root,
        "accumulate",
        ACCUMULATOR,
        CONFIG.format(strategy=CANDIDATES, idle=600_000_000, initial="zero_data: true"),
    )
    (root / "running_total" / "1").mkdir(parents=True)
    (root / "running_total" / "config.pbtxt").write_text(ENSEMBLE)
    return root


def sequence_request(model: str, value: int, sequence: int, start: bool, end: bool) -> pb.ModelInferRequest:
    tensor = "VALUE" if model == "running_total" else "INPUT"
    request = request_for(model, **{tensor: np.array([[value]], np.int32)})
    request.parameters["sequence_id"].int64_param = sequence
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    return request


async def inferences(address: str) -> int:
    async with inference_stub(address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="accumulate"))
    return reply.model_stats[0].inference_count


async def test_each_sequence_stays_on_one_replica_directly_and_through_an_ensemble(tmp_path: Path) -> None:
    root = repository(tmp_path / "models")
    backends = [PythonBackend()]
    async with (
        serving_stages([], repository=ModelRepository(root), backends=backends) as first,
        serving_stages([], repository=ModelRepository(root), backends=backends) as second,
    ):
        await wait_serving(first.address, timeout=60)
        await wait_serving(second.address, timeout=60)
        catalog = load_catalog(repository=root, stages={"python": f"ipv4:{first.address},{second.address}"})
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)

            async def run(sequence: int) -> list[int]:
                model = "running_total" if sequence % 2 else "accumulate"
                output = "TOTAL" if sequence % 2 else "OUTPUT"
                totals = []
                for step in range(6):
                    request = sequence_request(model, sequence + step, sequence, step == 0, step == 5)
                    reply = await stub.ModelInfer(request, timeout=30)
                    totals.append(int(response_tensors(reply)[output].to_array()[0, 0]))
                return totals

            results = await asyncio.gather(*(run(n) for n in range(1, 17)))
        for sequence, totals in enumerate(results, start=1):
            assert totals == [sum(sequence + k for k in range(step + 1)) for step in range(6)], sequence
        # Both replicas took sequences; a split sequence would have been refused by the replica it strayed to.
        a, b = await inferences(first.address), await inferences(second.address)
        assert a + b == 16 * 6 and a >= 12 and b >= 12, (a, b)


async def test_a_replica_that_goes_takes_only_its_own_sequences_with_it(tmp_path: Path) -> None:
    root = repository(tmp_path / "models")
    backends = [PythonBackend()]
    async with (
        serving_stages([], repository=ModelRepository(root), backends=backends) as first,
        serving_stages([], repository=ModelRepository(root), backends=backends) as second,
    ):
        await wait_serving(first.address, timeout=60)
        await wait_serving(second.address, timeout=60)
        catalog = load_catalog(repository=root, stages={"python": f"ipv4:{first.address},{second.address}"})
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            for sequence in range(1, 13):
                await stub.ModelInfer(sequence_request("accumulate", 1, sequence, True, False), timeout=30)
            on_first = await inferences(first.address)
            assert 0 < on_first < 12
            await first.stop()
            lost, kept = [], []
            for sequence in range(1, 13):
                try:
                    reply = await stub.ModelInfer(
                        sequence_request("accumulate", 1, sequence, False, True), timeout=30
                    )
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE
                    assert f"sequence {sequence} of model 'accumulate' is lost" in err.details()
                    assert first.address in err.details() and "sequence_start" in err.details()
                    lost.append(sequence)
                    continue
                assert int(response_tensors(reply)["OUTPUT"].to_array()[0, 0]) == 2
                kept.append(sequence)
            assert len(lost) == on_first and len(kept) == 12 - on_first
            # A lost sequence starts again, on the replica that is left.
            reply = await stub.ModelInfer(sequence_request("accumulate", 5, lost[0], True, True), timeout=30)
            assert int(response_tensors(reply)["OUTPUT"].to_array()[0, 0]) == 5


#: tritonclient as its users call a stateful model, in a process of its own (it registers Triton's own copy of
#: the protocol's messages): interleaved sequences over unary calls and over one gRPC stream, a request without
#: START, and a string sequence id; what it saw as JSON.
TRITON_CLIENT = r"""
import json, queue, sys
import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

url = sys.argv[1]
client = triton.InferenceServerClient(url)

def value(model, number):
    tensor = triton.InferInput("VALUE" if model == "running_total" else "INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[number]], np.int32))
    return [tensor]

def total(result, model):
    return int(result.as_numpy("TOTAL" if model == "running_total" else "OUTPUT")[0, 0])

report = {"unary": {}, "stream": {}, "refused": None}
for step in range(3):
    for sequence in (1001, 1002):
        result = client.infer("running_total", value("running_total", sequence % 100 * (step + 1)),
                              sequence_id=sequence, sequence_start=step == 0, sequence_end=step == 2)
        report["unary"].setdefault(str(sequence), []).append(total(result, "running_total"))
try:
    client.infer("accumulate", value("accumulate", 1), sequence_id=1001)
except InferenceServerException as exc:
    report["refused"] = [exc.status(), exc.message()]

done = queue.Queue()
client.start_stream(callback=lambda result, error: done.put((result, error)))
for step in range(12):
    for sequence in (2001, 2002, 2003):
        client.async_stream_infer("accumulate", value("accumulate", step + 1), request_id=f"{sequence}-{step}",
                                  sequence_id=sequence, sequence_start=step == 0, sequence_end=step == 11)
for _ in range(36):
    result, error = done.get(timeout=30)
    assert error is None, error
    sequence = result.get_response().id.split("-")[0]
    report["stream"].setdefault(sequence, []).append(total(result, "accumulate"))
client.stop_stream()
result = client.infer("accumulate", value("accumulate", 9), sequence_id="session-x", sequence_start=True,
                      sequence_end=True)
report["string"] = total(result, "accumulate")
print(json.dumps(report))
"""


async def test_tritonclient_gets_tritons_answers_over_calls_and_streams(tmp_path: Path) -> None:
    root = repository(tmp_path / "models")
    config = (root / "accumulate" / "config.pbtxt").read_text()
    (root / "accumulate" / "config.pbtxt").write_text(config.replace("TYPE_UINT64", "TYPE_STRING"))
    source = ACCUMULATOR.replace(
        'get("CORRID").astype(np.int64)', "np.array([[len(get('CORRID')[0, 0])]], np.int64)"
    )
    (root / "accumulate" / "1" / "model.py").write_text(source)
    backends = [PythonBackend()]
    async with (
        serving_stages([], repository=ModelRepository(root), backends=backends) as first,
        serving_stages([], repository=ModelRepository(root), backends=backends) as second,
    ):
        await wait_serving(first.address, timeout=60)
        await wait_serving(second.address, timeout=60)
        catalog = load_catalog(repository=root, stages={"python": f"ipv4:{first.address},{second.address}"})
        async with serving_router(catalog) as router:
            await wait_serving(router.address)
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-c", TRITON_CLIENT, router.address, stdout=PIPE, stderr=PIPE
            )
            out, err = await asyncio.wait_for(client.communicate(), 120)
            assert client.returncode == 0, err.decode()
    report = json.loads(out)
    assert report["unary"] == {"1001": [1, 3, 6], "1002": [2, 6, 12]}
    status, message = report["refused"]
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert "inference request for sequence 1001 to model 'accumulate' must specify the START flag" in message
    # A sequence's requests on a stream run in the order they were sent, one after the other.
    running = [sum(range(1, step + 2)) for step in range(12)]
    assert report["stream"] == {"2001": running, "2002": running, "2003": running}
    assert report["string"] == 9


async def test_pipeline_infer_sends_a_sequence(tmp_path: Path, capsys) -> None:
    root = repository(tmp_path / "models")
    async with serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage:
        await wait_serving(stage.address, timeout=60)
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(catalog) as router:
            await wait_serving(router.address)

            async def infer(*flags: str) -> int:
                argv = ["infer", "-m", "accumulate", "-u", router.address, "--json", "--value", *flags]
                return await asyncio.to_thread(main, argv)

            assert await infer("INPUT=4", "--sequence-id", "77", "--start") == 0
            assert await infer("INPUT=5", "--sequence-id", "77", "--end") == 0
            assert await infer("INPUT=6", "--sequence-id", "77") == 1
            assert await infer("INPUT=6", "--start") == 2
    out, err = capsys.readouterr()
    totals = [json.loads(line)["OUTPUT"] for line in out.splitlines()]
    assert totals == [[[4]], [[9]]]
    assert "INVALID_ARGUMENT: " in err and "sequence 77" in err and "START flag" in err
    assert "--start and --end need --sequence-id" in err


#: A stateful model that hands each request on to `accumulate` (also stateful) with its own sequence's
#: correlation id and flags, through the router (Triton's BLS): ten times what `accumulate` answers.
RELAY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="accumulate",
                inputs=[pb_utils.Tensor("INPUT", value)],
                requested_output_names=["OUTPUT"],
                correlation_id=request.correlation_id(),
                flags=request.flags(),
            )
            reply = call.exec()
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=reply.error()))
                continue
            total = pb_utils.get_output_tensor_by_name(reply, "OUTPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", total * 10)]))
        return responses
"""

RELAY_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching { oldest { max_candidate_sequences: 8 } }
"""


async def test_a_stateful_model_calls_another_with_its_sequence(tmp_path: Path) -> None:
    root = repository(tmp_path / "models")
    write_model(root, "relay", RELAY, RELAY_CONFIG)
    port_file = tmp_path / "router.port"
    async with serving_stages(
        [],
        repository=ModelRepository(root),
        backends=[PythonBackend()],
        options={"router_port_file": port_file},
    ) as stage:
        await wait_serving(stage.address, timeout=60)
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            port_file.write_text(router.address.rsplit(":", 1)[1])
            await wait_serving(router.address)

            async def run(sequence: int) -> list[int]:
                totals = []
                for step in range(4):
                    request = sequence_request("relay", step + sequence, sequence, step == 0, step == 3)
                    reply = await stub.ModelInfer(request, timeout=30)
                    totals.append(int(response_tensors(reply)["OUTPUT"].to_array()[0, 0]))
                return totals

            results = await asyncio.gather(*(run(n) for n in (1, 2, 3)))
            # Sequence 1 has ended: its next request without START is refused.
            error = await rpc_error(
                stub.ModelInfer(sequence_request("relay", 1, 1, False, False), timeout=30)
            )
    for sequence, totals in zip((1, 2, 3), results, strict=True):
        assert totals == [10 * sum(sequence + k for k in range(step + 1)) for step in range(4)]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence 1 to model 'relay' must specify the START flag" in error.details()


async def test_a_sequence_over_http_json(tmp_path: Path) -> None:
    """The KServe v2 HTTP/REST protocol carries a sequence in the request's parameters, as Triton's HTTP
    clients send it: a number or a string id."""
    root = repository(tmp_path / "models")
    config = (root / "accumulate" / "config.pbtxt").read_text()
    (root / "accumulate" / "config.pbtxt").write_text(config.replace("TYPE_UINT64", "TYPE_STRING"))
    source = ACCUMULATOR.replace(
        'get("CORRID").astype(np.int64)', "np.array([[len(get('CORRID')[0, 0])]], np.int64)"
    )
    (root / "accumulate" / "1" / "model.py").write_text(source)
    async with serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage:
        await wait_serving(stage.address, timeout=60)
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(catalog) as router, aiohttp.ClientSession() as http:
            await wait_serving(router.address)
            url = f"http://{router.http_address}/v2/models/accumulate/infer"

            async def send(value: int, parameters: dict) -> tuple[int, dict]:
                body = {
                    "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [value]}],
                    "parameters": parameters,
                }
                async with http.post(url, json=body) as reply:
                    return reply.status, await reply.json()

            status, first = await send(3, {"sequence_id": "s-1", "sequence_start": True})
            assert status == 200, first
            status, second = await send(4, {"sequence_id": "s-1", "sequence_end": True})
            outputs = {o["name"]: o["data"] for o in second["outputs"]}
            assert status == 200 and outputs["OUTPUT"] == [7] and outputs["CORRID_OUT"] == [len("s-1")]
            status, refused = await send(5, {"sequence_id": "s-1"})
    assert status == 400 and "must specify the START flag on the first request" in refused["error"]


async def test_sequences_carry_on_when_a_replica_joins(tmp_path: Path) -> None:
    """A replica that joins (a scale-up) ranks first for some sequences that started before it: their requests
    still reach the replica that holds them, through the router that started them (it remembers) and through
    one that never saw them (the replica that joined refuses them unrun, and the next one up is asked), while
    new sequences spread over both."""
    root = repository(tmp_path / "models")
    backends = [PythonBackend()]
    names: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        return list(names)

    catalog = load_catalog(repository=root, stages={"python": "dns:///accumulate.test:8101"})
    options = {"resolve_interval": 0.1}
    async with (
        serving_stages([], repository=ModelRepository(root), backends=backends) as first,
        serving_stages([], repository=ModelRepository(root), backends=backends) as second,
    ):
        await wait_serving(first.address, timeout=60)
        await wait_serving(second.address, timeout=60)
        names.append(first.address)
        async with serving_router(catalog, resolve=resolve, options=options) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                for sequence in range(1, 9):
                    await stub.ModelInfer(
                        sequence_request("accumulate", sequence, sequence, True, False), timeout=30
                    )
                assert await inferences(first.address) == 8
                names.append(second.address)
                # New sequences reach the replica that joined once the router has looked the name up again.
                sequence = 100
                while await inferences(second.address) == 0:
                    sequence += 1
                    await stub.ModelInfer(sequence_request("accumulate", 1, sequence, True, True), timeout=30)
                for sequence in range(1, 9):
                    reply = await stub.ModelInfer(
                        sequence_request("accumulate", 1, sequence, False, False), timeout=30
                    )
                    assert int(response_tensors(reply)["OUTPUT"].to_array()[0, 0]) == sequence + 1
        # Another router (a worker that took none of their requests) finds them too.
        async with serving_router(catalog, resolve=resolve, options=options) as other:
            await wait_serving(other.address)
            async with inference_stub(other.address) as stub:
                for sequence in range(1, 9):
                    reply = await stub.ModelInfer(
                        sequence_request("accumulate", 1, sequence, False, True), timeout=30
                    )
                    assert int(response_tensors(reply)["OUTPUT"].to_array()[0, 0]) == sequence + 2
    # The router ranks the addresses its look-up gives (host:port).
    joined = [
        s for s in range(1, 9) if rendezvous([first.address, second.address], f"n:{s}")[0] == second.address
    ]
    assert joined, "no sequence ranks the replica that joined first: the test proves nothing"


BATCHED_ENSEMBLE = """
name: batched_totals
stages:
  s: {{address: "{address}", dynamic_batching: {{max_batch_size: 8}}}}
inputs: [{{name: VALUE, datatype: INT32, shape: [-1, 1]}}]
outputs: [{{name: TOTAL, datatype: INT32, shape: [-1, 1]}}]
steps:
  - {{model_name: accumulate, stage: s, input_map: {{INPUT: VALUE}}, output_map: {{OUTPUT: TOTAL}}}}
"""


async def test_an_ensemble_that_gives_a_sequence_model_dynamic_batching_is_refused(tmp_path: Path) -> None:
    """The router's batches would merge the requests of many sequences into one with none of their ids: the
    ensemble is refused, naming the model, and the model itself serves."""
    root = repository(tmp_path / "models")
    async with serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage:
        await wait_serving(stage.address, timeout=60)
        (tmp_path / "batched.yaml").write_text(BATCHED_ENSEMBLE.format(address=stage.address))
        catalog = load_ensembles([tmp_path / "batched.yaml"], exit_on_error=False)
        options = {"exit_on_error": False}
        async with serving_router(catalog, options=options) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
            states = {m.name: (m.state, m.reason) for m in index.models}
            state, reason = states["batched_totals"]
            assert state == "UNAVAILABLE" and "model 'accumulate' has sequence_batching" in reason, reason
            reply = await stub.ModelInfer(sequence_request("accumulate", 3, 5, True, True), timeout=30)
            assert int(response_tensors(reply)["OUTPUT"].to_array()[0, 0]) == 3


async def test_a_sequence_models_statistics_at_the_router_are_its_replicas_own(tmp_path: Path) -> None:
    """Triton's statistics of a model are its own executions, whatever batched them: eight sequences on two
    replicas whose sequence batchers run their steps together, and the router answers with the sum of the
    replicas' own figures (40 inferences in fewer executions), not with its 40 calls of one request each."""
    root = tmp_path / "models"
    write_model(
        root,
        "accumulate",
        ACCUMULATOR,
        CONFIG.format(strategy=OLDEST, idle=600_000_000, initial="zero_data: true"),
    )
    backends = [PythonBackend()]
    async with (
        serving_stages([], repository=ModelRepository(root), backends=backends) as first,
        serving_stages([], repository=ModelRepository(root), backends=backends) as second,
    ):
        await wait_serving(first.address, timeout=60)
        await wait_serving(second.address, timeout=60)
        addresses = [first.address, second.address]
        catalog = load_catalog(repository=root, stages={"python": f"ipv4:{first.address},{second.address}"})
        metrics = Metrics()
        async with serving_router(catalog, metrics=metrics) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            # The sequences spread over both replicas once both are seen serving.
            ready = "pipeline_stage_replicas_ready"
            while metrics.registry.get_sample_value(ready, {"stage": "python"}) != 2:
                await asyncio.sleep(0.05)

            async def run(sequence: int) -> None:
                for step in range(5):
                    request = sequence_request("accumulate", step, sequence, step == 0, step == 4)
                    await stub.ModelInfer(request, timeout=30)

            await asyncio.gather(*(run(s) for s in range(1, 9)))
            (model,) = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="accumulate"))).model_stats
            every = await stub.ModelStatistics(pb.ModelStatisticsRequest())
        replicas = [await statistics(address, "accumulate") for address in addresses]
    assert (model.name, model.version) == ("accumulate", "1")
    summed = pb.ModelStatistics()
    summed.CopyFrom(replicas[0])
    add_statistics(summed, replicas[1])
    assert min(r.inference_count for r in replicas) > 0  # both replicas ran sequences
    assert (model.inference_count, model.execution_count) == (40, summed.execution_count)
    assert model.execution_count < 40  # steps of several sequences ran as one batch
    assert sum(b.batch_size * b.compute_infer.count for b in model.batch_stats) == 40
    assert list(model.batch_stats) == list(summed.batch_stats)
    assert model.inference_stats == summed.inference_stats
    assert [s for s in every.model_stats if s.name == "accumulate"] == [model]


async def statistics(address: str, model: str) -> pb.ModelStatistics:
    async with inference_stub(address) as stub:
        return (await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))).model_stats[0]


#: A plain Python model beside the sequence model on the same stage.
ECHO = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy())])
            for r in requests
        ]
"""
ECHO_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
#: Two slots, sequences idle for a second released, and at most 8 sequences waiting for a slot.
SMALL = "oldest { max_candidate_sequences: 2 max_queue_delay_microseconds: 1000 }"
BACKLOG = 8


async def test_abandoned_starts_give_their_places_back_at_their_deadlines_and_a_full_backlog_refuses_at_once(
    tmp_path: Path,
) -> None:
    """Sequences started and never ended, with short deadlines, through a router (the stage learns a deadline,
    not that the caller went): the starts past the backlog are refused at once, those waiting are answered
    at their deadlines, the slots held go at the idle time all at once, and then a new sequence starts at
    once while the other model of the stage answers throughout."""
    root = tmp_path / "models"
    config = CONFIG.format(strategy=SMALL, idle=1_000_000, initial="zero_data: true")
    config += f'parameters {{ key: "pipeline.max_sequence_backlog" value {{ string_value: "{BACKLOG}" }} }}\n'
    write_model(root, "accumulate", ACCUMULATOR, config)
    write_model(root, "echo", ECHO, ECHO_CONFIG)
    async with serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage:
        await wait_serving(stage.address, timeout=60)
        catalog = load_catalog(repository=root, stages={"python": f"ipv4:{stage.address}"})
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            for sequence in (1, 2):  # they hold both slots until they are idle
                await stub.ModelInfer(sequence_request("accumulate", 1, sequence, True, False), timeout=30)
            waiting = [
                asyncio.ensure_future(
                    rpc_error(stub.ModelInfer(sequence_request("accumulate", 1, n, True, False), timeout=0.3))
                )
                for n in range(100, 100 + BACKLOG)
            ]
            await asyncio.sleep(0)
            refused = await asyncio.gather(
                *(
                    rpc_error(stub.ModelInfer(sequence_request("accumulate", 1, n, True, False), timeout=30))
                    for n in range(200, 204)
                )
            )
            assert not any(task.done() for task in waiting)  # the refusals did not wait for them
            for error in refused:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert "Exceeds maximum queue size" in error.details()
                assert f"{BACKLOG} sequence(s) wait" in error.details(), error.details()
            echo = request_for("echo", INPUT=np.array([[7]], np.int32))
            assert response_tensors(await stub.ModelInfer(echo, timeout=5))["OUTPUT"].to_array().tolist() == [
                [7]
            ]
            for error in await asyncio.gather(*waiting):
                assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            # The stage answered each at its deadline: nothing of them is left, and once the two sequences that
            # hold the slots have been idle a second, a new sequence has the first slot.
            reply = await stub.ModelInfer(sequence_request("accumulate", 5, 300, True, False), timeout=5)
            assert int(response_tensors(reply)["OUTPUT"].to_array()[0, 0]) == 5
            refused_later = await rpc_error(
                stub.ModelInfer(sequence_request("accumulate", 1, 100, False, False))
            )
            assert "must specify the START flag" in refused_later.details()
            assert response_tensors(await stub.ModelInfer(echo, timeout=5))["OUTPUT"].to_array().tolist() == [
                [7]
            ]


async def test_a_streams_next_request_of_a_sequence_waits_at_the_stage_while_the_one_before_runs(
    tmp_path: Path,
) -> None:
    """Three sequences of two requests each, sent up front on one stream through the router, to a model that
    takes 0.3 s a batch (preferred size 2): as in Triton, the second requests of the first batch's sequences
    reach the stage while it runs and join the third sequence's first in the next batch (batches of 2, 3
    and 1). Before, the router sent a sequence's next request only once the one before it was answered, and
    the stage's next batch could not wait for them (batches of 2 only)."""
    slow = ACCUMULATOR.replace(
        "        responses = []\n", "        time.sleep(0.3)\n        responses = []\n"
    )
    strategy = "oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 500000 }"
    root = tmp_path / "models"
    write_model(
        root,
        "accumulate",
        "import time\n" + slow,
        CONFIG.format(strategy=strategy, idle=600_000_000, initial="zero_data: true"),
    )
    # The router calls the stage on its frame port (as `pipeline run` has it): one connection, in order.
    options = {"frames_port": 0}
    async with serving_stages(
        [], repository=ModelRepository(root), backends=[PythonBackend()], options=options
    ) as stage:
        await wait_serving(stage.address, timeout=60)
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            sends = [
                sequence_request("accumulate", 10 * sequence + step, sequence, step == 0, step == 1)
                for step in range(2)
                for sequence in (1, 2, 3)
            ]
            for index, request in enumerate(sends):
                request.id = str(index)
            answers: dict[str, dict[str, int]] = {}
            async for reply in stub.ModelStreamInfer(iter(sends), timeout=30):
                assert not reply.error_message, reply.error_message
                tensors = response_tensors(reply.infer_response)
                answers[reply.infer_response.id] = {
                    name: int(tensors[name].to_array()[0, 0]) for name in ("OUTPUT", "BATCH")
                }
    assert [answers[str(index)]["OUTPUT"] for index in range(6)] == [10, 20, 30, 21, 41, 61]
    assert sorted(answer["BATCH"] for answer in answers.values()) == [1, 2, 2, 3, 3, 3]
