"""Python stages served from a repository by a real stage service: the example stages, an unmodified Triton
Python model, and the repository lifecycle (add, replace under traffic, remove, refuse a bad model.py)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_catalog, load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.api import Stage
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.stages import (
    EXAMPLE_REPOSITORY,
    GATE,
    GATED_MODEL,
    TRITON_ADD_SUB_CONFIG,
    TRITON_ADD_SUB_MODEL,
    example_repository,
    example_stage,
    write_model,
)

EXAMPLES = [
    "digits_preprocess",
    "embeddings_tokenize",
    "refcnn_preprocess",
    "digits_postprocess",
    "embeddings_pool",
    "refcnn_postprocess",
    "digits_blank",
]

SCALE = """
from pipeline.stage import Stage, TensorSpec

class Scale(Stage):
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def infer(self, inputs):
        return {"Y": inputs["X"] * FACTOR}

FACTOR = 2.0
"""


def outputs(reply: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    return {name: tensor.to_array() for name, tensor in response_tensors(reply).items()}


def serving(root: Path, models: list[str] | None = None):
    """A stage service of `root`'s python models, in explicit model-control mode (it loads on request)."""
    return serving_stages(
        [],
        repository=ModelRepository(root),
        backends=[PythonBackend()],
        models=models,
        options={"model_control_mode": "explicit"},
    )


async def index(stub) -> dict[str, tuple[str, str]]:
    reply = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
    return {m.name: (m.state, m.reason) for m in reply.models}


async def test_the_example_stages_are_served_from_the_repository(tmp_path: Path) -> None:
    root = example_repository(tmp_path, EXAMPLES)
    async with serving(root) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=60)
        assert await index(stub) == {name: ("READY", "") for name in EXAMPLES}

        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="digits_preprocess"))).config
        assert config.backend == "python" and config.max_batch_size == 256
        assert config.parameters["max_image_pixels"].string_value == "16000000"
        assert [i.name for i in config.input] == ["IMAGE"] and [o.name for o in config.output] == [
            "PIXELS",
            "INK",
        ]

        png = io.BytesIO()
        Image.new("L", (16, 16), 255).save(png, format="PNG")
        images = np.empty((1, 1), object)
        images[0, 0] = png.getvalue()
        pixels = outputs(await stub.ModelInfer(request_for("digits_preprocess", IMAGE=images)))["PIXELS"]
        assert pixels.shape == (1, 1, 8, 8) and not pixels.any()

        logits = np.array([[0.0] * 9 + [5.0]], np.float32)
        out = outputs(await stub.ModelInfer(request_for("refcnn_postprocess", LOGITS=logits)))
        assert out["LABEL"].tolist() == [[9]] and 0.9 < out["PROB"][0, 0] <= 1.0


async def test_load_model_serves_only_the_models_named(tmp_path: Path) -> None:
    root = example_repository(tmp_path, EXAMPLES)
    async with serving(root, ["refcnn_preprocess", "refcnn_postprocess"]) as stage:
        await wait_serving(stage.address, timeout=60)
        async with inference_stub(stage.address) as stub:
            assert set(await index(stub)) == {"refcnn_preprocess", "refcnn_postprocess"}
            error = await rpc_error(
                stub.ModelInfer(request_for("digits_postprocess", LOGITS=np.zeros((1, 10))))
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_an_unmodified_triton_python_model_through_a_stage_and_the_router(tmp_path: Path) -> None:
    write_model(tmp_path / "repository", "add_sub", TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG)
    async with serving(tmp_path / "repository") as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=60)
        a, b = np.random.default_rng(0).random((2, 4), dtype=np.float32)
        out = outputs(await stub.ModelInfer(request_for("add_sub", INPUT0=a, INPUT1=b)))
        np.testing.assert_allclose(out["OUTPUT0"], a + b)
        np.testing.assert_allclose(out["OUTPUT1"], a - b)
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="add_sub"))).config
        assert config.backend == "python" and [i.name for i in config.input] == ["INPUT0", "INPUT1"]

        (tmp_path / "e.yaml").write_text(
            f"""
name: sums
max_batch_size: 0
stages:
  s: {{address: "{stage.address}"}}
inputs: [{{name: A, datatype: FP32, shape: [4]}}, {{name: B, datatype: FP32, shape: [4]}}]
outputs: [{{name: SUM, datatype: FP32, shape: [4]}}]
steps:
  - {{model_name: add_sub, stage: s, input_map: {{INPUT0: A, INPUT1: B}}, output_map: {{OUTPUT0: SUM}}}}
"""
        )
        async with (
            serving_router(load_ensembles([tmp_path])) as router,
            inference_stub(router.address) as router_stub,
        ):
            await wait_serving(router.address)
            out = outputs(await router_stub.ModelInfer(request_for("sums", A=a, B=b)))
            np.testing.assert_allclose(out["SUM"], a + b)


async def test_an_error_response_of_a_triton_model_answers_with_its_code(tmp_path: Path) -> None:
    source = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                error = pb_utils.TritonError("X must not be negative", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
            elif (x == 5).any():
                error = pb_utils.TritonError("five is for later", pb_utils.TritonError.UNSUPPORTED)
                responses.append(pb_utils.InferenceResponse(error=error))
            elif (x == 7).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("seven broke it")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses
"""
    config = """
backend: "python"
max_batch_size: 8
input { name: "X" data_type: TYPE_FP32 dims: [2] }
output { name: "Y" data_type: TYPE_FP32 dims: [2] }
"""
    write_model(tmp_path, "doubler", source, config)
    async with serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=60)
        x = np.ones((3, 2), np.float32)
        np.testing.assert_array_equal(outputs(await stub.ModelInfer(request_for("doubler", X=x)))["Y"], x * 2)
        for value, code, message in (
            (-1, grpc.StatusCode.INVALID_ARGUMENT, "X must not be negative"),
            (5, grpc.StatusCode.UNIMPLEMENTED, "five is for later"),
            (7, grpc.StatusCode.INTERNAL, "seven broke it"),  # Triton's default code, as Triton answers it
        ):
            error = await rpc_error(stub.ModelInfer(request_for("doubler", X=x * value)))
            assert (error.code(), error.details()) == (code, message)
        np.testing.assert_array_equal(outputs(await stub.ModelInfer(request_for("doubler", X=x)))["Y"], x * 2)


async def test_load_adds_replaces_under_traffic_and_unload_removes(tmp_path: Path) -> None:
    path = write_model(tmp_path, "scale", SCALE)
    async with serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=60)

        # Added at run time: a new folder, then RepositoryModelLoad.
        write_model(tmp_path, "added", SCALE.replace("FACTOR = 2.0", "FACTOR = -1.0"))
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="added"))
        x = np.ones((1, 3), np.float32)
        assert outputs(await stub.ModelInfer(request_for("added", X=x)))["Y"].tolist() == [[-1.0] * 3]

        # Replaced while clients keep sending: every request succeeds, with the old factor or the new.
        seen: list[float] = []
        errors: list[BaseException] = []
        replaced, flowing = asyncio.Event(), asyncio.Event()

        async def client(index: int) -> None:
            after = 0
            while after < 5:
                x = np.full((2, 3), index + 1, np.float32)
                sent_after_load = replaced.is_set()
                try:
                    y = outputs(await stub.ModelInfer(request_for("scale", X=x), timeout=30))["Y"]
                except grpc.aio.AioRpcError as err:
                    errors.append(err)
                    return
                factors = set((y / x).ravel().tolist())
                assert len(factors) == 1
                seen.append(factors.pop())
                if len(seen) >= 12:
                    flowing.set()
                if sent_after_load:
                    after += 1
                    assert seen[-1] == 3.0  # a request sent after the load finished sees the new code

        clients = [asyncio.create_task(client(i)) for i in range(6)]
        await flowing.wait()  # traffic is flowing before the load
        path.write_text(SCALE.replace("FACTOR = 2.0", "FACTOR = 3.0"))
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="scale"))
        replaced.set()
        await asyncio.gather(*clients)
        assert not errors
        assert set(seen) == {2.0, 3.0} and seen.count(3.0) >= 6 * 5

        # Removed: refused from then on, listed as unloaded.
        await stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="added"))
        error = await rpc_error(stub.ModelInfer(request_for("added", X=x)))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert (await index(stub))["added"] == ("UNAVAILABLE", "unloaded")
        assert outputs(await stub.ModelInfer(request_for("scale", X=x)))["Y"].tolist() == [[3.0] * 3]


async def test_a_bad_model_py_is_refused_naming_the_file_while_the_others_serve(tmp_path: Path) -> None:
    good = write_model(tmp_path, "scale", SCALE)
    bad = write_model(tmp_path, "broken", "import numpy\n\nraise RuntimeError('the weights are missing')\n")
    two = write_model(tmp_path, "two", SCALE + "\n\nclass Again(Scale):\n    pass\n")
    async with serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=60)
        listed = await index(stub)
        assert listed["scale"] == ("READY", "")
        state, reason = listed["broken"]
        assert state == "UNAVAILABLE" and str(bad) in reason and "line 3" in reason
        assert "RuntimeError: the weights are missing" in reason

        for name, path, cause in (
            ("broken", bad, "the weights are missing"),
            ("two", two, "defines 2 Stage subclasses (Scale, Again)"),
        ):
            error = await rpc_error(stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(path) in error.details() and cause in error.details()

        # A model.py replaced by a broken one is refused, and the version serving goes on serving.
        good.write_text("from pipeline.stage import Stage\n")
        error = await rpc_error(stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="scale")))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(good) in error.details() and "defines no Stage subclass" in error.details()
        x = np.ones((1, 3), np.float32)
        assert outputs(await stub.ModelInfer(request_for("scale", X=x)))["Y"].tolist() == [[2.0] * 3]

        error = await rpc_error(
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="../scale"))
        )
        assert error.code() == grpc.StatusCode.NOT_FOUND and "not a plain name" in error.details()


#: Triton's sequence example as a Python model: the running sum of a sequence's INPUT, restarted where its
#: START control input is 1; its config asks for sequence batching with START and READY control inputs.
ACCUMULATE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.total = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            if pb_utils.get_input_tensor_by_name(request, "START").as_numpy()[0, 0]:
                self.total = 0
            self.total += int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()[0, 0])
            total = pb_utils.Tensor("OUTPUT", np.array([[self.total]], np.int32))
            responses.append(pb_utils.InferenceResponse([total]))
        return responses
"""
ACCUMULATE_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  iterative_sequence: true
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
instance_group [ { kind: KIND_CPU } ]
"""


async def test_sequence_batching_that_asks_for_what_is_not_served_is_refused_at_load_naming_the_field(
    tmp_path: Path,
) -> None:
    """A part of sequence batching not served here (`iterative_sequence`): its model is refused at load (listed
    UNAVAILABLE with the reason, its requests answered UNAVAILABLE with it) instead of failing every request,
    and the others serve."""
    write_model(tmp_path, "accumulate", ACCUMULATE, ACCUMULATE_CONFIG)
    write_model(tmp_path, "add_sub", TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG)
    config = tmp_path / "accumulate" / "config.pbtxt"
    async with serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=60)
        listed = await index(stub)
        assert listed["add_sub"] == ("READY", "")
        state, reason = listed["accumulate"]
        assert state == "UNAVAILABLE" and str(config) in reason, reason
        assert "sequence_batching: iterative_sequence is not supported" in reason
        assert not (await stub.ModelReady(pb.ModelReadyRequest(name="accumulate"))).ready

        request = request_for("accumulate", INPUT=np.array([[1]], np.int32))
        error = await rpc_error(stub.ModelInfer(request))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "iterative_sequence is not supported" in error.details()
        error = await rpc_error(
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="accumulate"))
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(config) in error.details() and "iterative_sequence is not supported" in error.details()

        ones = np.ones(4, np.float32)
        reply = await stub.ModelInfer(request_for("add_sub", INPUT0=ones, INPUT1=ones))
        assert outputs(reply)["OUTPUT0"].tolist() == [2.0] * 4


async def test_unload_lets_the_request_in_flight_finish_first(tmp_path: Path) -> None:
    write_model(tmp_path, "gated", GATED_MODEL)
    GATE["entered"].clear()
    GATE["release"].clear()
    GATE["events"].clear()
    async with serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=60)
        x = np.arange(3, dtype=np.float32)
        call = asyncio.ensure_future(stub.ModelInfer(request_for("gated", X=x), timeout=30))
        await asyncio.to_thread(GATE["entered"].wait, 30)
        unload = asyncio.ensure_future(
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="gated"))
        )
        # The model stops taking requests as soon as the unload begins; its instance waits for the one in flight.
        while (await stub.ModelReady(pb.ModelReadyRequest(name="gated"))).ready:
            await asyncio.sleep(0.01)
        assert not unload.done() and GATE["events"] == []
        GATE["release"].set()
        np.testing.assert_array_equal(outputs(await call)["Y"], x)
        await unload
        assert GATE["events"] == ["infer finished", "unloaded"]


class _DigitsCNN(Stage):
    """Stands in for the model service's `digits_cnn`: any fixed function of the pixels will do."""

    name = "digits_cnn"
    max_batch_size = 64
    inputs = (TensorSpec("INPUT", "FP32", (-1, 1, 8, 8)),)
    outputs = (TensorSpec("LOGITS", "FP32", (-1, 10)),)

    def infer(self, inputs):
        return {"LOGITS": inputs["INPUT"].reshape(-1, 64)[:, 20:30].copy()}


class _RefCNN(Stage):
    name = "refcnn_cnn"
    max_batch_size = 64
    inputs = (TensorSpec("INPUT", "FP32", (-1, 3, 64, 64)),)
    outputs = (TensorSpec("LOGITS", "FP32", (-1, 10)),)

    def infer(self, inputs):
        return {"LOGITS": inputs["INPUT"].mean(axis=(1, 2))[:, :10].copy()}


class _Encoder(Stage):
    name = "minilm_encoder"
    max_batch_size = 64
    inputs = (
        TensorSpec("INPUT_IDS", "INT64", (-1, -1), pad_value=0),
        TensorSpec("ATTENTION_MASK", "INT64", (-1, -1), pad_value=0),
    )
    outputs = (TensorSpec("TOKEN_EMBEDDINGS", "FP32", (-1, -1, 384), pad_value=0),)

    def infer(self, inputs):
        ids = inputs["INPUT_IDS"].astype(np.float32)
        return {"TOKEN_EMBEDDINGS": np.sin(ids[..., None] * np.arange(1, 385, dtype=np.float32) / 997)}


async def test_the_ensembles_of_the_tree_run_unchanged_over_the_repository_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example repository's YAML ensembles over its stages (model steps stood in for): the router's
    answers are what the same stages give composed in-process."""
    models = [_DigitsCNN(), _RefCNN(), _Encoder()]
    async with serving(example_repository(tmp_path, EXAMPLES)) as stages, serving_stages(models) as model:
        await wait_serving(stages.address, timeout=60)
        for variable, address in (("PREPROCESS", stages.address), ("MODEL", model.address)):
            monkeypatch.setenv(f"{variable}_ADDRESS", address)
        monkeypatch.setenv("POSTPROCESS_ADDRESS", stages.address)
        async with (
            serving_router(load_catalog(repository=EXAMPLE_REPOSITORY)) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address, timeout=60)

            def chain(
                first: str, model: Stage, last: str, arrays: dict[str, np.ndarray]
            ) -> dict[str, np.ndarray]:
                pre = example_stage(first).infer(arrays)
                # The image ensembles feed PIXELS to the model and only its output on; embeddings feed all.
                middle = model.infer({"INPUT": pre["PIXELS"]} if "PIXELS" in pre else pre)
                return example_stage(last).infer(middle if "PIXELS" in pre else {**pre, **middle})

            png = io.BytesIO()
            Image.fromarray(np.tril(np.full((24, 24), 255, np.uint8))).save(png, format="PNG")
            images = np.empty((2, 1), object)
            images[:, 0] = [png.getvalue(), png.getvalue()]
            out = outputs(await stub.ModelInfer(request_for("digits", IMAGE=images), timeout=30))
            expected = chain("digits_preprocess", models[0], "digits_postprocess", {"IMAGE": images})
            np.testing.assert_array_equal(out["LABEL"], expected["LABEL"])
            np.testing.assert_allclose(out["SCORES"], expected["SCORES"], rtol=1e-6)

            # digits_gated: a digit goes the digits way; a blank image gets the fixed answer.
            blank = io.BytesIO()
            Image.fromarray(np.full((24, 24), 255, np.uint8)).save(blank, format="PNG")
            for data, label, scores in (
                (png.getvalue(), expected["LABEL"][:1], expected["SCORES"][:1]),
                (blank.getvalue(), np.array([[-1]]), np.zeros((1, 10), np.float32)),
            ):
                image = np.empty((1, 1), object)
                image[0, 0] = data
                out = outputs(await stub.ModelInfer(request_for("digits_gated", IMAGE=image), timeout=30))
                np.testing.assert_array_equal(out["LABEL"], label)
                np.testing.assert_allclose(out["SCORES"], scores, rtol=1e-6)

            pictures = np.random.default_rng(3).integers(0, 256, (3, 3, 64, 64), dtype=np.uint8)
            out = outputs(await stub.ModelInfer(request_for("refcnn", IMAGE=pictures), timeout=30))
            expected = chain("refcnn_preprocess", models[1], "refcnn_postprocess", {"IMAGE": pictures})
            np.testing.assert_array_equal(out["LABEL"], expected["LABEL"])
            np.testing.assert_allclose(out["PROB"], expected["PROB"], rtol=1e-6)

            texts = np.array([[b"A cat sat on the mat."], [b"Hi"]], dtype=object)
            out = outputs(await stub.ModelInfer(request_for("embeddings", TEXT=texts), timeout=30))
            expected = chain("embeddings_tokenize", models[2], "embeddings_pool", {"TEXT": texts})
            np.testing.assert_allclose(out["EMBEDDING"], expected["EMBEDDING"], rtol=1e-5, atol=1e-6)
