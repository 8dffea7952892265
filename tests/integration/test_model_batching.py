"""A model's batching is the model's: declared once in its config.pbtxt and shared by every ensemble that
calls it. An ensemble of its own (a foreign OIP server as one branch, the example's refcnn models as the
other, no batching settings) is served beside the example ensembles, through real stage services and the
router, and its refcnn branch answers as the refcnn ensemble does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_catalog
from pipeline.ensemble.plan import Catalog
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.errors import ConfigError
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import Running, serving_router, serving_stages
from services.model.backend import ModelBackend
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.integration.test_plain_oip_stage import PlainServicer, plain_server
from tests.integration.test_telemetry import _scrape
from tests.stages import EXAMPLE_REPOSITORY, example_repository

REFCNN = ["refcnn_preprocess", "refcnn_cnn", "refcnn_postprocess"]
STAGES = ("preprocess", "model", "postprocess")

#: The hold-out: refcnn's models on our stages beside `negate` on a foreign server; no batching stated.
MIXED = """
name: mixed
max_batch_size: 8
stages:
  preprocess: {{address: "${{PREPROCESS_ADDRESS}}"}}
  model: {{address: "${{MODEL_ADDRESS}}"}}
  postprocess: {{address: "${{POSTPROCESS_ADDRESS}}"}}
  foreign: {{address: "{foreign}"}}
inputs:
  - {{name: IMAGE, datatype: UINT8, shape: [-1, 3, 64, 64]}}
  - {{name: X, datatype: FP32, shape: [-1, 3]}}
outputs:
  - {{name: LABEL, datatype: INT64, shape: [-1, 1]}}
  - {{name: PROB, datatype: FP32, shape: [-1, 1]}}
  - {{name: NEGATED, datatype: FP32, shape: [-1, 3]}}
steps:
  - {{model_name: refcnn_preprocess, stage: preprocess, input_map: {{IMAGE: IMAGE}}, output_map: {{PIXELS: p}}}}
  - {{model_name: refcnn_cnn, stage: model, input_map: {{INPUT: p}}, output_map: {{LOGITS: logits}}}}
  - {{model_name: refcnn_postprocess, stage: postprocess, input_map: {{LOGITS: logits}},
     output_map: {{LABEL: LABEL, PROB: PROB}}}}
  - {{model_name: negate, stage: foreign, input_map: {{X: X}}, output_map: {{NEG: NEGATED}}}}
"""

#: An ensemble that restates refcnn_cnn's batching, differently from the model's own.
RESTATING = """
name: restating
max_batch_size: 8
stages:
  model:
    address: "${MODEL_ADDRESS}"
    dynamic_batching: {max_batch_size: 8, max_queue_delay_microseconds: 100}
inputs: [{name: PIXELS, datatype: FP32, shape: [-1, 3, 64, 64]}]
outputs: [{name: LOGITS, datatype: FP32, shape: [-1, 10]}]
steps:
  - {model_name: refcnn_cnn, stage: model, input_map: {INPUT: PIXELS}, output_map: {LOGITS: LOGITS}}
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every example of the tree's repository, with refcnn's model file built as `make model` builds it."""
    from examples.models.build import build

    names = sorted(p.name for p in EXAMPLE_REPOSITORY.iterdir() if p.is_dir() and not p.name.startswith("."))
    root = example_repository(tmp_path_factory.mktemp("examples"), names)
    build(root, ["refcnn_cnn"], progress=False, report=lambda _: None)
    return root


@contextlib.asynccontextmanager
async def stages(root: Path) -> AsyncIterator[tuple[Running, str]]:
    """refcnn's models on one stage service (serving as each of the three stages), and the foreign server."""
    backends = [PythonBackend(), ModelBackend(Runners(device="cpu"))]
    async with (
        serving_stages([], repository=ModelRepository(root), backends=backends, models=REFCNN) as stage,
        plain_server(PlainServicer()) as foreign,
    ):
        await wait_serving(stage.address, timeout=120)
        yield stage, foreign


def catalog(root: Path, folder: Path, stage: Running, *, exit_on_error: bool = True) -> Catalog:
    """What `pipeline router --model-dir ROOT --ensembles FOLDER` serves, the stages at `stage`."""
    environ = {f"{name.upper()}_ADDRESS": stage.address for name in STAGES}
    stage_keys = dict.fromkeys(STAGES, stage.address)
    return load_catalog(
        [folder], repository=root, stages=stage_keys, environ=environ, exit_on_error=exit_on_error
    )


async def batched(metrics: Metrics, model: str) -> tuple[bool, float]:
    """Whether the router has a batcher for `model` (its queue-depth gauge), and how many requests waited in
    that batcher's queue (the queue-wait histogram's count)."""
    samples = await asyncio.to_thread(_scrape, metrics)
    labels = (("model", model),)
    return ("pipeline_queue_depth", labels) in samples, samples.get(
        ("pipeline_queue_duration_seconds_count", labels), 0.0
    )


async def test_an_ensemble_without_batching_settings_shares_the_models_batcher(repository, tmp_path):
    images = np.random.default_rng(7).integers(0, 256, size=(3, 3, 64, 64), dtype=np.uint8)
    x = np.array([[1, -2, 3], [4, 5, -6], [0, 1, 2]], np.float32)
    async with stages(repository) as (stage, foreign):
        (tmp_path / "mixed.yaml").write_text(MIXED.format(foreign=foreign))
        served = catalog(repository, tmp_path, stage)
        assert {"mixed", "refcnn", "digits", "embeddings"} <= set(served.ensembles)
        metrics = Metrics()
        async with (
            serving_router(served, metrics=metrics, metrics_port=0) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            before = await batched(metrics, "refcnn_cnn")
            reply = await stub.ModelInfer(request_for("refcnn", IMAGE=images), timeout=30)
            alone = {name: t.to_array() for name, t in response_tensors(reply).items()}
            reply = await stub.ModelInfer(request_for("mixed", IMAGE=images, X=x), timeout=30)
            mixed = {name: t.to_array() for name, t in response_tensors(reply).items()}
            # Both branches answer: refcnn's as the refcnn ensemble does, the foreign one its own way.
            np.testing.assert_array_equal(mixed["LABEL"], alone["LABEL"])
            np.testing.assert_array_equal(mixed["PROB"], alone["PROB"])
            np.testing.assert_array_equal(mixed["NEGATED"], -x)
            # One batcher for the model, as its config says: both ensembles' requests waited in its queue.
            assert await batched(metrics, "refcnn_cnn") == (True, before[1] + 2)
            config = (await stub.ModelConfig(pb.ModelConfigRequest(name="refcnn_cnn"))).config
            assert config.dynamic_batching.max_queue_delay_microseconds == 20000
            # The examples whose models this stage does not serve wait for them, and say so.
            index = {
                m.name: m.state for m in (await stub.RepositoryIndex(pb.RepositoryIndexRequest())).models
            }
            assert (index["mixed"], index["refcnn"], index["digits"]) == ("READY", "READY", "UNAVAILABLE")


async def test_an_ensemble_restating_a_models_batching_differently_fails_alone(repository, tmp_path):
    async with stages(repository) as (stage, foreign):
        (tmp_path / "mixed.yaml").write_text(MIXED.format(foreign=foreign))
        (tmp_path / "restating.yaml").write_text(RESTATING)
        # Triton's default: the router stops, naming the ensemble's file, the model and its config.
        async with serving_router(catalog(repository, tmp_path, stage)) as router:
            with pytest.raises(ConfigError) as info:
                await router.task
        expected = (
            f"{tmp_path / 'restating.yaml'} (step 0 (refcnn_cnn)): model 'refcnn_cnn' has dynamic_batching "
            "(BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=100"
        )
        assert str(info.value).startswith(expected)
        config = repository / "refcnn_cnn" / "config.pbtxt"
        assert f"in {config} (its ModelConfig on stage 'model')" in str(info.value)

        served = catalog(repository, tmp_path, stage, exit_on_error=False)
        options = {"exit_on_error": False}
        async with serving_router(served, options=options) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            err = await rpc_error(
                stub.ModelInfer(request_for("restating", PIXELS=np.zeros((1, 3, 64, 64), np.float32)))
            )
            assert err.code() == grpc.StatusCode.UNAVAILABLE and str(info.value) in err.details()
            assert not (await stub.ModelReady(pb.ModelReadyRequest(name="restating"))).ready
            images = np.zeros((1, 3, 64, 64), np.uint8)
            reply = await stub.ModelInfer(request_for("mixed", IMAGE=images, X=np.ones((1, 3), np.float32)))
            assert response_tensors(reply)["LABEL"].to_array().shape == (1, 1)
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="refcnn"))).ready
