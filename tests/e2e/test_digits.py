"""The digits ensemble end to end: four processes, real images, our client, Triton's client, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

from examples.digit_images import encode
from examples.models.digits import load_split
from pipeline.tools.client import InferenceClient, bytes_batch
from tests.e2e.conftest import REPO

pytestmark = pytest.mark.e2e

VARIANTS = [
    {"scale": 1},
    {"scale": 4},
    {"scale": 4, "invert": True},
    {"scale": 8, "mode": "RGB"},
    {"scale": 5, "fmt": "JPEG"},
    {"scale": 3, "mode": "RGB", "fmt": "JPEG", "invert": True},
    {"scale": 16, "mode": "RGBA"},
]


def test_held_out_accuracy_through_the_whole_pipeline(pipeline):
    _, _, x_test, y_test = load_split()
    images = [encode(x, **VARIANTS[i % len(VARIANTS)]) for i, x in enumerate(x_test)]
    labels = []
    with InferenceClient(pipeline.router.address) as client:
        for start in range(0, len(images), 64):
            chunk = images[start : start + 64]
            out = client.infer("digits", {"IMAGE": bytes_batch(chunk, (-1, 1))}, timeout=60)
            assert out["LABEL"].shape == (len(chunk), 1) and out["LABEL"].dtype == np.int64
            assert out["SCORES"].shape == (len(chunk), 10) and out["SCORES"].dtype == np.float32
            np.testing.assert_allclose(out["SCORES"].sum(axis=1), 1.0, rtol=1e-5)
            np.testing.assert_array_equal(out["LABEL"][:, 0], out["SCORES"].argmax(axis=1))
            labels.extend(out["LABEL"][:, 0].tolist())
    accuracy = float(np.mean(np.array(labels) == y_test))
    print(f"digits held-out accuracy through the pipeline: {accuracy:.2%} on {len(y_test)} images")
    assert accuracy >= 0.95


TRITON_CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as triton

url, *paths = sys.argv[1:]
client = triton.InferenceServerClient(url)
report = {"live": client.is_server_live(), "ready": client.is_server_ready(),
          "model_ready": client.is_model_ready("digits")}
meta = client.get_model_metadata("digits", as_json=True)
report["inputs"] = meta["inputs"]
report["outputs"] = meta["outputs"]
config = client.get_model_config("digits", as_json=True)["config"]
report["platform"] = config["platform"]
report["steps"] = [s["model_name"] for s in config["ensemble_scheduling"]["step"]]
report["member_configs"] = {s: client.get_model_config(s, as_json=True)["config"].get("max_batch_size", 0)
                            for s in report["steps"]}
images = np.array([[open(p, "rb").read()] for p in paths], dtype=np.object_)
image = triton.InferInput("IMAGE", list(images.shape), "BYTES")
image.set_data_from_numpy(images)
result = client.infer("digits", [image], outputs=[triton.InferRequestedOutput("LABEL"),
                                                  triton.InferRequestedOutput("SCORES")])
report["labels"] = result.as_numpy("LABEL")[:, 0].tolist()
report["scores_shape"] = list(result.as_numpy("SCORES").shape)
member = client.infer("digits_postprocess",
                      [triton.InferInput("LOGITS", [1, 10], "FP32").set_data_from_numpy(
                          np.eye(10, dtype=np.float32)[[7]] * 20)])
report["member_label"] = int(member.as_numpy("LABEL")[0, 0])
print(json.dumps(report))
"""


def held_out_files(tmp_path, count: int) -> tuple[list[str], list[int]]:
    _, _, x_test, y_test = load_split()
    paths = []
    for i in range(count):
        path = tmp_path / f"digit-{i}.png"
        path.write_bytes(encode(x_test[i], scale=6))
        paths.append(str(path))
    return paths, y_test[:count].tolist()


def test_tritons_python_client_classifies_through_the_router(pipeline, tmp_path):
    # A separate process: tritonclient registers Triton's own copy of the protocol's messages.
    paths, truth = held_out_files(tmp_path, 6)
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CLIENT, pipeline.router.address, *paths],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["live"] and report["ready"] and report["model_ready"]
    assert report["inputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": ["-1", "1"]}]
    assert [o["name"] for o in report["outputs"]] == ["LABEL", "SCORES"]
    assert report["platform"] == "ensemble"
    assert report["steps"] == ["digits_preprocess", "digits_cnn", "digits_postprocess"]
    assert all(size > 0 for size in report["member_configs"].values())
    assert report["labels"] == truth
    assert report["scores_shape"] == [6, 10]
    assert report["member_label"] == 7


def test_cli_infer_prints_each_files_label(pipeline, tmp_path):
    paths, truth = held_out_files(tmp_path, 3)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "infer",
            "--model",
            "digits",
            "--url",
            pipeline.router.address,
            *paths,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3
    for line, path, label in zip(lines, paths, truth, strict=True):
        assert line.startswith(f"{path}: LABEL={label}")


def test_python_example_uses_generated_stubs(pipeline, tmp_path):
    paths, truth = held_out_files(tmp_path, 1)
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "client.py"), "--url", pipeline.router.address, paths[0]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"digit {truth[0]}" in done.stdout


def test_an_undecodable_image_is_named_by_its_index(pipeline):
    _, _, x_test, _ = load_split()
    good = encode(x_test[0])
    with InferenceClient(pipeline.router.address) as client:
        for bad, index in ((b"definitely not an image", 1), (good[:40], 2)):
            batch = [good, good, good]
            batch[index] = bad
            with pytest.raises(grpc.RpcError) as info:
                client.infer("digits", {"IMAGE": bytes_batch(batch, (-1, 1))}, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"IMAGE[{index}]" in info.value.details()
            assert "digits_preprocess" in info.value.details()
        out = client.infer("digits", {"IMAGE": bytes_batch([good], (-1, 1))}, timeout=30)
        assert out["LABEL"].shape == (1, 1)


def test_bad_requests_through_the_router(pipeline):
    with InferenceClient(pipeline.router.address, max_message_bytes=64 * 1024 * 1024) as client:
        cases = [
            ("nope", {"IMAGE": bytes_batch([b"x"], (-1, 1))}, grpc.StatusCode.NOT_FOUND, "nope"),
            (
                "digits",
                {"PICTURE": bytes_batch([b"x"], (-1, 1))},
                grpc.StatusCode.INVALID_ARGUMENT,
                "PICTURE",
            ),
            ("digits", {"IMAGE": np.zeros((1, 1), np.float32)}, grpc.StatusCode.INVALID_ARGUMENT, "BYTES"),
            (
                "digits",
                {"IMAGE": bytes_batch([b"x", b"y"], (-1,))},
                grpc.StatusCode.INVALID_ARGUMENT,
                "[-1, 1]",
            ),
            # 20 MiB against the router's 16 MiB limit
            (
                "digits",
                {"IMAGE": bytes_batch([b"\0" * (20 << 20)], (-1, 1))},
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "",
            ),
        ]
        for model, inputs, code, words in cases:
            with pytest.raises(grpc.RpcError) as info:
                client.infer(model, inputs, timeout=30)
            assert info.value.code() == code, info.value.details()
            assert words in (info.value.details() or "")
        assert client.server_ready(timeout=5)


TRITON_HTTP_CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.http as triton

url, listing, form = sys.argv[1:]
paths = json.load(open(listing))
binary = form == "binary"
client = triton.InferenceServerClient(url)
report = {"live": client.is_server_live(), "ready": client.is_server_ready(),
          "model_ready": client.is_model_ready("digits")}
meta = client.get_model_metadata("digits")
report["inputs"], report["outputs"] = meta["inputs"], meta["outputs"]
config = client.get_model_config("digits")
report["steps"] = [s["model_name"] for s in config["ensemble_scheduling"]["step"]]


def infer(model, name, datatype, array, outputs, **kwargs):
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary or datatype == "BYTES")
    wanted = [triton.InferRequestedOutput(o, binary_data=binary) for o in outputs]
    return client.infer(model, [tensor], outputs=wanted, **kwargs)


labels = []
for start in range(0, len(paths), 64):
    images = np.array([[open(p, "rb").read()] for p in paths[start : start + 64]], dtype=np.object_)
    if binary:  # the ensemble, images and outputs as binary tensor data
        result = infer("digits", "IMAGE", "BYTES", images, ["LABEL", "SCORES"])
        assert result.as_numpy("SCORES").shape == (len(images), 10)
    else:  # image files are not UTF-8 text, so they go binary; from there on every tensor is JSON
        pixels = infer("digits_preprocess", "IMAGE", "BYTES", images, ["PIXELS"]).as_numpy("PIXELS")
        logits = infer("digits_cnn", "INPUT", "FP32", pixels, ["LOGITS"]).as_numpy("LOGITS")
        result = infer("digits_postprocess", "LOGITS", "FP32", logits, ["LABEL"])
    labels += result.as_numpy("LABEL")[:, 0].tolist()
report["labels"] = labels
# Compressed both ways, as tritonclient offers it.
images = np.array([[open(paths[0], "rb").read()]], dtype=np.object_)
squeezed = infer("digits", "IMAGE", "BYTES", images, ["LABEL"],
                 request_compression_algorithm="gzip", response_compression_algorithm="deflate")
report["compressed_label"] = int(squeezed.as_numpy("LABEL")[0, 0])
stats = client.get_inference_statistics("digits")["model_stats"][0]
report["inference_count"] = stats["inference_count"]
try:
    client.infer("nope", [triton.InferInput("IMAGE", [1, 1], "BYTES").set_data_from_numpy(images)])
except triton.InferenceServerException as err:
    report["unknown_model"] = [err.status(), err.message()]
print(json.dumps(report))
"""


@pytest.mark.parametrize("form", ["binary", "json"])
def test_tritons_http_client_classifies_as_well_as_grpc(pipeline, tmp_path, form):
    _, _, x_test, y_test = load_split()
    paths = []
    for i, x in enumerate(x_test):
        path = tmp_path / f"digit-{i}.{'jpg' if VARIANTS[i % len(VARIANTS)].get('fmt') == 'JPEG' else 'png'}"
        path.write_bytes(encode(x, **VARIANTS[i % len(VARIANTS)]))
        paths.append(str(path))
    listing = tmp_path / "paths.json"
    listing.write_text(json.dumps(paths))
    grpc_labels = []
    with InferenceClient(pipeline.router.address) as client:
        for start in range(0, len(paths), 64):
            chunk = [open(p, "rb").read() for p in paths[start : start + 64]]  # noqa: SIM115
            out = client.infer("digits", {"IMAGE": bytes_batch(chunk, (-1, 1))}, timeout=60)
            grpc_labels.extend(out["LABEL"][:, 0].tolist())
    # A separate process, as for Triton's gRPC client.
    done = subprocess.run(
        [sys.executable, "-c", TRITON_HTTP_CLIENT, pipeline.router.http_address, str(listing), form],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["live"] and report["ready"] and report["model_ready"]
    assert report["inputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1, 1]}]
    assert [o["name"] for o in report["outputs"]] == ["LABEL", "SCORES"]
    assert report["steps"] == ["digits_preprocess", "digits_cnn", "digits_postprocess"]
    http_accuracy = float(np.mean(np.array(report["labels"]) == y_test))
    grpc_accuracy = float(np.mean(np.array(grpc_labels) == y_test))
    print(f"digits held-out accuracy over HTTP ({form}): {http_accuracy:.2%}, over gRPC: {grpc_accuracy:.2%}")
    assert report["labels"] == grpc_labels and http_accuracy >= 0.95
    assert report["compressed_label"] == grpc_labels[0]
    assert report["inference_count"] >= 1
    status, message = report["unknown_model"]
    assert str(status) == "404", status
    assert "unknown model 'nope'" in message
