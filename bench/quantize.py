"""INT8 against FP32 on the CPU for the examples' CNNs: `python -m bench.quantize`.

The digits CNN (TorchScript) and refcnn's CNN (ONNX) are built (`examples.models.build`), then quantized by
`pipeline quantize`'s code in each of its forms (static QDQ or QOperator, per channel or per tensor, reduced
range; dynamic), calibrated on 256 of the digits' training images and compared on the 360 held-out ones
(refcnn sees them as 64x64 RGB images through its own preprocess). Printed:

- per form: top-1 agreement with FP32, the largest absolute difference, and ONNX Runtime's CPU per batch of
  FP32 and INT8 (the report `pipeline quantize` writes);
- the model step as the service runs it, per image at batch 16 (one intra-op thread, CPU time): the FP32
  version with its own runner (torch for the digits, ONNX Runtime for refcnn) against the INT8 version,
  measured in alternation;
- the digits' accuracy through the pipeline (preprocess of PNG images, the model, postprocess) with each;
- which operators ONNX Runtime runs the INT8 graph with once it has optimised it, and the CPU's VNNI flags.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from services.model.backend import ModelBackend, ServiceSettings
from services.model.quantize import QuantizeSettings, quantize

#: The tree's repository: the python stages around the CNNs.
TREE = Path(__file__).resolve().parents[1] / "model_repository"
#: Weights in 8 bits unless a form says reduce_range (7 bits), whatever the CPU, so that each form is the same on
#: every machine; none is refused for its agreement (a form that saturates here shows it in the table).
FORMS = [
    ("static QDQ, per channel", QuantizeSettings(format="qdq", per_channel=True, reduce_range=False)),
    ("static QDQ, per tensor", QuantizeSettings(format="qdq", per_channel=False, reduce_range=False)),
    (
        "static QOperator, per channel",
        QuantizeSettings(format="qoperator", per_channel=True, reduce_range=False),
    ),
    (
        "static QOperator, per tensor",
        QuantizeSettings(format="qoperator", per_channel=False, reduce_range=False),
    ),
    ("static QDQ, per channel, reduce_range", QuantizeSettings(per_channel=True, reduce_range=True)),
    ("dynamic", QuantizeSettings(method="dynamic", reduce_range=False)),
]


def _stage(name: str) -> Any:
    entry = ModelRepository(TREE).read(name)
    instance = PythonBackend().prepare(entry, entry.served_versions()[-1]).instances[0]
    instance.load()
    return instance.stage  # type: ignore[attr-defined]


def _png(digit: np.ndarray) -> bytes:
    from PIL import Image

    grey = np.rint(digit * (255.0 / 16.0)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(255 - grey, "L").resize((32, 32), Image.Resampling.NEAREST).save(buffer, "PNG")
    return buffer.getvalue()


def _refcnn_pixels(digits: np.ndarray, preprocess: Any) -> np.ndarray:
    """Digits as refcnn's input: 64x64 RGB UINT8 images through refcnn's preprocess."""
    grey = np.rint(digits[:, 0] * (255.0 / 16.0)).astype(np.uint8)
    images = np.repeat(np.repeat(grey, 8, axis=1), 8, axis=2)
    images = np.ascontiguousarray(np.broadcast_to(images[:, None], (len(images), 3, 64, 64)))
    return np.concatenate(
        [preprocess.infer({"IMAGE": images[i : i + 64]})["PIXELS"] for i in range(0, len(images), 64)]
    )


def _instance(root: Path, name: str, version: str, runner: str = "auto") -> Any:
    repository = ModelRepository(root)
    config = repository.read(name).config
    config.parameters["runner"].string_value = runner
    entry = repository.read(name, config)
    (instance,) = ModelBackend(ServiceSettings(device="cpu", threads=1)).prepare(entry, version).instances
    instance.load()
    return instance


def _cpu_per_image(
    instances: dict[str, Any], feeds: dict[str, np.ndarray], runs: int, rounds: int
) -> dict[str, float]:
    """CPU µs per image of each instance's `run` on one batch; rounds alternate between the instances and
    the best round counts (the least disturbed by the other processes of the machine)."""
    batch = len(next(iter(feeds.values())))
    best = dict.fromkeys(instances, float("inf"))
    for instance in instances.values():
        for _ in range(5):
            instance.run(feeds)
    for _ in range(rounds):
        for label, instance in instances.items():
            start = time.process_time()
            for _ in range(runs):
                instance.run(feeds)
            best[label] = min(best[label], (time.process_time() - start) / runs / batch * 1e6)
    return best


def _int8_operators(path: Path) -> str:
    """The operators of the graph ONNX Runtime runs once it has optimised the file."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(options.optimized_model_filepath).graph
    counts = Counter(node.op_type for node in graph.node)
    return ", ".join(f"{op} x{n}" for op, n in counts.most_common())


def _vnni() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "unknown"
    found = sorted({f for f in flags if f in ("avx512_vnni", "avx_vnni", "amx_int8")})
    return ", ".join(found) or "none (8-bit multiply-adds without VNNI)"


def _forms(folder: Path, built: Path, names: list[str], batch_size: int, runs: int) -> None:
    """Each model quantized in each form, in a repository of its own under `folder`, and its report as a
    table row."""
    print(
        "| model | form | top-1 agreement | max abs diff | ORT FP32 CPU/batch | INT8 CPU/batch | speed-up |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names:
        for label, form in FORMS:
            root = folder / f"{name}-{label}".replace(" ", "_").replace(",", "")
            shutil.copytree(built / name, root / name)
            report = quantize(
                root,
                name,
                QuantizeSettings(
                    method=form.method,
                    format=form.format,
                    per_channel=form.per_channel,
                    reduce_range=form.reduce_range,
                    calibration=folder / f"{name}-calibration.npy",
                    evaluation=folder / f"{name}-evaluation.npy",
                    batch_size=batch_size,
                    runs=runs,
                    force=True,
                ),
            )
            assert report.fp32 and report.int8
            print(
                f"| {name} | {label} | {report.top1_agreement['LOGITS']:.2%} | "
                f"{report.max_abs_diff['LOGITS']:.3f} | {report.fp32.cpu_ms_per_batch * 1e3:.0f} µs | "
                f"{report.int8.cpu_ms_per_batch * 1e3:.0f} µs | {report.cpu_speedup:.2f}x |"
            )


def _model_steps(
    folder: Path, evaluations: dict[str, np.ndarray], batch_size: int, runs: int, rounds: int
) -> None:
    """The model step as the service runs it, FP32 against the static QDQ per channel version that `_forms`
    wrote, CPU per image, and the INT8 graph's operators."""
    print("\nThe model step as the service runs it (static QDQ, per channel), CPU per image:")
    print(
        "| model | FP32 (its runner) | FP32 (ONNX Runtime) | INT8 (ONNX Runtime) | FP32 / INT8 | ORT FP32 / INT8 |"
    )
    print("|---|---|---|---|---|---|")
    for name, evaluation in evaluations.items():
        root = folder / f"{name}-static_QDQ_per_channel"
        fp32, int8 = _instance(root, name, "1"), _instance(root, name, "2")
        # A PyTorch file runs on ONNX Runtime as its export: FP32 and INT8 in the same runtime.
        ort_fp32 = _instance(root, name, "1", runner="onnxruntime")
        feeds = {"INPUT": np.ascontiguousarray(evaluation[:batch_size])}
        cpu = _cpu_per_image({"fp32": fp32, "ort": ort_fp32, "int8": int8}, feeds, runs, rounds)
        print(
            f"| {name} | {cpu['fp32']:.1f} µs ({fp32.runner}) | {cpu['ort']:.1f} µs | {cpu['int8']:.1f} µs | "
            f"{cpu['fp32'] / cpu['int8']:.2f}x | {cpu['ort'] / cpu['int8']:.2f}x |"
        )
        print(
            f"\n  {name} INT8 graph as ONNX Runtime runs it: {_int8_operators(root / name / '2' / 'model.onnx')}\n"
        )


def _pipeline_accuracy(root: Path, x_test: np.ndarray, y_test: np.ndarray) -> None:
    """The digits' accuracy through the pipeline (PNG images, preprocess, the CNN, postprocess) with the FP32
    version and with the INT8 one of the repository at `root`."""
    pre, post = _stage("digits_preprocess"), _stage("digits_postprocess")
    images = np.empty((len(x_test), 1), dtype=object)
    for i, digit in enumerate(x_test[:, 0]):
        images[i, 0] = _png(digit)
    accuracy = {}
    for version in ("1", "2"):
        model = _instance(root, "digits_cnn", version)
        labels = []
        for start in range(0, len(images), 64):
            pixels = pre.infer({"IMAGE": images[start : start + 64]})["PIXELS"]
            logits = model.run({"INPUT": pixels})["LOGITS"]
            labels.append(post.infer({"LOGITS": logits})["LABEL"][:, 0])
        accuracy[version] = float(np.mean(np.concatenate(labels) == y_test))
    print(
        f"digits through the pipeline (PNG -> preprocess -> CNN -> postprocess), {len(images)} held-out "
        f"images: FP32 {accuracy['1']:.2%}, INT8 {accuracy['2']:.2%} "
        f"({(accuracy['2'] - accuracy['1']) * 100:+.2f} points)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=100, help="runs of a batch per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed rounds")
    args = parser.parse_args()

    from examples.models.build import build
    from examples.models.digits import load_split

    x_train, _, x_test, y_test = load_split()
    refcnn_pre = _stage("refcnn_preprocess")
    samples = {
        "digits_cnn": (x_train[:256], x_test),
        "refcnn_cnn": (_refcnn_pixels(x_train[:256], refcnn_pre), _refcnn_pixels(x_test, refcnn_pre)),
    }
    print(f"CPU VNNI: {_vnni()}; batch {args.batch_size}, one intra-op thread\n")
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        folder = Path(tmp)
        built = folder / "built"
        build(built, list(samples), progress=False, report=lambda _: None)
        for name, (calibration, evaluation) in samples.items():
            np.save(folder / f"{name}-calibration.npy", calibration)
            np.save(folder / f"{name}-evaluation.npy", evaluation)
        _forms(folder, built, list(samples), args.batch_size, args.runs)
        evaluations = {name: evaluation for name, (_, evaluation) in samples.items()}
        _model_steps(folder, evaluations, args.batch_size, args.runs, args.rounds)
        _pipeline_accuracy(folder / "digits_cnn-static_QDQ_per_channel", x_test, y_test)


if __name__ == "__main__":
    main()
