"""What NVIDIA's `custom_metrics` and `auto_complete` python_backend examples do, through real servers: models
written with the same API (`pb_utils.MetricFamily` of each kind, `family.Metric(labels=...)`, `increment`,
`set`, `observe`, `value`; `auto_complete_config` with `set_max_batch_size(0)`, `add_input`, `add_output`)
served by a stage service behind the router, and a client that reads the router's HTTP/REST and `/metrics`
as the examples' clients do."""

from __future__ import annotations

import asyncio
import urllib.request

import aiohttp
import pytest

from pipeline.ensemble.catalog import load_catalog
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import wait_serving
from tests.stages import write_model

#: The custom_metrics example's model, with a gauge and a histogram beside its counter, and counts that do
#: not depend on time.
METRICS_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        self.out0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.metric_family = pb_utils.MetricFamily(
            name="requests_processed",
            description="Requests processed",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.metric = self.metric_family.Metric(labels={"version": "1", "model": "custom_metrics"})
        self.last = pb_utils.MetricFamily(
            name="last_input_sum", description="Sum of the last INPUT0", kind=pb_utils.MetricFamily.GAUGE
        ).Metric()
        self.values = pb_utils.MetricFamily(
            name="input_values", description="INPUT0's elements", kind=pb_utils.MetricFamily.HISTOGRAM
        ).Metric(labels={"model": "custom_metrics"}, buckets=[1.0, 2.5])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", (in_0 + in_1).astype(self.out0_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            self.last.set(float(in_0.sum()))
            for value in in_0.ravel():
                self.values.observe(float(value))
        self.metric.increment(len(requests))
        pb_utils.Logger.log_info(f"requests processed: {self.metric.value()}")
        return responses
"""

METRICS_CONFIG = """
name: "custom_metrics"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 3 kind: KIND_CPU } ]
"""

#: The auto_complete example's models: no config.pbtxt; the model says its tensors and max_batch_size.
AUTO_COMPLETE_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        names = [tensor["name"] for tensor in config["input"] + config["output"]]
        for tensor in [
            {{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}},
            {{"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]}},
        ]:
            if tensor["name"] not in names:
                auto_complete_model_config.add_input(tensor)
        if "OUTPUT0" not in names:
            auto_complete_model_config.add_output({{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}})
        auto_complete_model_config.set_max_batch_size({max_batch_size})
        {dynamic}
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", in_0)]))
        return responses
"""
EXPECTED_MAX_BATCH_SIZE = {"nobatch_auto_complete": 0, "batch_auto_complete": 4}
EXPECTED_INPUTS = [
    {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
    {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]},
]
EXPECTED_OUTPUTS = [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]


class Served:
    def __init__(self, http: str, router_metrics: Metrics, stage_metrics: Metrics) -> None:
        self.http, self.router_metrics, self.stage_metrics = http, router_metrics, stage_metrics


@pytest.fixture(scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("examples") / "models"
    write_model(root, "custom_metrics", METRICS_MODEL, METRICS_CONFIG)
    write_model(root, "nobatch_auto_complete", AUTO_COMPLETE_MODEL.format(max_batch_size=0, dynamic=""))
    dynamic = "auto_complete_model_config.set_dynamic_batching()"
    write_model(root, "batch_auto_complete", AUTO_COMPLETE_MODEL.format(max_batch_size=4, dynamic=dynamic))
    stage_metrics, router_metrics = Metrics(), Metrics()
    async with serving_stages(
        [],
        repository=ModelRepository(root),
        backends=[PythonBackend()],
        metrics=stage_metrics,
        metrics_port=0,
    ) as stage:
        await wait_serving(stage.address)
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(catalog, metrics=router_metrics, metrics_port=0) as router:
            await wait_serving(router.address)
            assert router.http_address is not None
            yield Served(router.http_address, router_metrics, stage_metrics)


def _scrape(metrics: Metrics) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as reply:
        return reply.read().decode()


#: The model's families after the two requests of the test, as Triton writes them.
FAMILIES = """\
# HELP requests_processed Requests processed
# TYPE requests_processed counter
requests_processed{model="custom_metrics",version="1"} 2
# HELP last_input_sum Sum of the last INPUT0
# TYPE last_input_sum gauge
last_input_sum 10
# HELP input_values INPUT0's elements
# TYPE input_values histogram
input_values_count{model="custom_metrics"} 8
input_values_sum{model="custom_metrics"} 12
input_values_bucket{model="custom_metrics",le="1"} 5
input_values_bucket{model="custom_metrics",le="2.5"} 6
input_values_bucket{model="custom_metrics",le="+Inf"} 8
"""


async def test_custom_metrics_on_the_stages_and_the_routers_metrics(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        for in_0 in ([0.5, 0.5, 0.5, 0.5], [1.0, 2.0, 3.0, 4.0]):
            request = {
                "inputs": [
                    {"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": in_0},
                    {"name": "INPUT1", "datatype": "FP32", "shape": [4], "data": [1, 1, 1, 1]},
                ]
            }
            async with http.post(
                f"http://{served.http}/v2/models/custom_metrics/infer", json=request
            ) as reply:
                assert reply.status == 200, await reply.text()
                assert (await reply.json())["outputs"][0]["data"] == [v + 1 for v in in_0]
    for metrics in (served.stage_metrics, served.router_metrics):
        text = await asyncio.to_thread(_scrape, metrics)
        # After Triton's families, as Triton writes its models' families beside its own.
        assert "nv_inference_count" in text[: text.index("# HELP requests_processed")]
        assert text[text.index("# HELP requests_processed") :] == FAMILIES


async def test_the_auto_completed_config_over_http_has_every_field(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        for name, max_batch_size in EXPECTED_MAX_BATCH_SIZE.items():
            async with http.get(f"http://{served.http}/v2/models/{name}/config") as reply:
                assert reply.status == 200, await reply.text()
                model_config = await reply.json()
            # As the example's client reads it.
            assert model_config["max_batch_size"] == max_batch_size
            for ios, expected in (
                (model_config["input"], EXPECTED_INPUTS),
                (model_config["output"], EXPECTED_OUTPUTS),
            ):
                assert [{key: io[key] for key in ("name", "data_type", "dims")} for io in ios] == expected
                assert all(io["is_shape_tensor"] is False for io in ios)
            assert model_config["parameters"] == {} and model_config["model_warmup"] == []
        # Statistics of a model nothing was asked of: every field, as Triton writes them.
        async with http.get(f"http://{served.http}/v2/models/nobatch_auto_complete/stats") as reply:
            (stats,) = (await reply.json())["model_stats"]
    assert stats["inference_count"] == stats["execution_count"] == stats["last_inference"] == 0
    assert (
        stats["inference_stats"]["success"] == stats["inference_stats"]["cache_miss"] == {"count": 0, "ns": 0}
    )
    assert stats["batch_stats"] == [] and stats["response_stats"] == {}
