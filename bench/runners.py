"""`python -m bench.runners`: the model service's runners side by side on the same network.

No gRPC, no router: each runner is the instance the model service would run (`ModelBackend.prepare`, then
`load`), driven directly as its thread drives it, so the figures are the runner's own. The network is the
throughput workload's `refcnn_cnn` (fixed seed), or ResNet-18 (`--network resnet18`), written three ways into
a temporary repository: ONNX (`model.onnx`, run by ONNX Runtime), a `torch.export` program (`model.pt2`) and
TorchScript (`model.pt`), both run by PyTorch. Every runner gets the same intra-op thread count (the
service's default, 1). On a GPU where TensorRT runs, TensorRT at FP32, FP16 and INT8 (the ONNX file's
`pipeline quantize` version, calibrated on random images) and torch in FP16 join them.

The machine is shared and noisy, so each figure is measured `--rounds` times, the runners interleaved, and
the median is printed beside every round's figure.

    python -m bench.runners                         # CPU, batch 1, 8, 32
    python -m bench.runners --batches 1 8 32 128 --rounds 5 --seconds 2
    python -m bench.runners --device cuda:0         # the GPU runners, where there is one
    python -m bench.runners --device cuda:0 --network resnet18 --batches 16
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.runtime.repository import ModelRepository
from services.model.quantize import QuantizeSettings, quantize

FP16_TENSORRT = (
    'optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "tensorrt" '
    'parameters { key: "precision_mode" value: "FP16" } } ] } }'
)
FP16_TORCH = 'optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "auto_mixed_precision" } ] } }'
#: runner label → (model file, config `parameters` runner, more config)
RUNNERS = {
    "onnxruntime": ("model.onnx", "onnxruntime", ""),
    "torch (pt2)": ("model.pt2", "torch", ""),
    "torch (pt)": ("model.pt", "torch", ""),
}
#: Added on a GPU where TensorRT runs: engines built from the ONNX file, at FP32 and FP16, from its INT8
#: version (`pipeline quantize`, static QDQ), and torch in FP16.
GPU_RUNNERS = {
    "tensorrt": ("model.onnx", "tensorrt", ""),
    "tensorrt fp16": ("model.onnx", "tensorrt", FP16_TENSORRT),
    "tensorrt int8": ("model.onnx", "tensorrt", ""),
    "torch fp16 (pt)": ("model.pt", "torch", FP16_TORCH),
}
#: The runners that run the model's INT8 version (2), calibrated on random images.
INT8 = ("tensorrt int8",)
CONFIG = """
name: "{name}"
max_batch_size: {max_batch}
input [ {{ name: "INPUT", data_type: TYPE_FP32, dims: [ {dims} ] }} ]
output [ {{ name: "LOGITS", data_type: TYPE_FP32, dims: [ {classes} ] }} ]
parameters [ {{ key: "runner", value: {{ string_value: "{runner}" }} }} ]
{extra}
"""


#: The networks the runners are compared on: `refcnn` (the throughput workload's CNN, fixed seed) and
#: `resnet18` (examples/resnet18, random weights from a fixed seed), each with its input shape and classes.
NETWORKS = ("refcnn", "resnet18")


def network(name: str) -> tuple[Any, tuple[int, ...], int]:
    """The module (in eval mode), its input shape without the batch, and its number of classes."""
    import torch

    if name == "refcnn":
        from examples.models.refcnn import INPUT_SHAPE, NUM_CLASSES, build_refcnn

        return build_refcnn(), INPUT_SHAPE, NUM_CLASSES
    from examples.resnet18.export import ResNet18

    torch.manual_seed(0)
    return ResNet18().eval(), (3, 224, 224), 1000


def write_models(
    root: Path, max_batch: int, runners: dict[str, tuple[str, str, str]], net: str = "refcnn"
) -> dict[str, str]:
    """The network as ONNX, `torch.export` and TorchScript, a repository entry per runner; returns runner →
    model name."""
    import torch

    module, shape, classes = network(net)
    names = {}
    for label, (file_name, runner, extra) in runners.items():
        name = f"{net}_" + "".join(c if c.isalnum() else "_" for c in label)
        folder = root / name
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(
            CONFIG.format(
                name=name,
                max_batch=max_batch,
                runner=runner,
                extra=extra,
                dims=", ".join(map(str, shape)),
                classes=classes,
            )
        )
        path = folder / "1" / file_name
        example = torch.zeros((2, *shape))
        with torch.no_grad():
            if file_name == "model.onnx":
                torch.onnx.export(
                    module, (example,), str(path), input_names=["INPUT"], output_names=["LOGITS"],
                    dynamic_axes={"INPUT": {0: "batch"}, "LOGITS": {0: "batch"}}, dynamo=False,
                )  # fmt: skip
            elif file_name == "model.pt2":
                batch = torch.export.Dim("batch", min=1, max=max_batch)
                program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
                torch.export.save(program, str(path))
            else:
                torch.jit.trace(module, example).save(str(path))
        names[label] = name
    return names


def measure(instance, batch: int, seconds: float, shape: tuple[int, ...]) -> float:
    """Items per second of `instance` on batches of `batch` random images, after a warm-up."""
    inputs = {"INPUT": np.random.default_rng(batch).standard_normal((batch, *shape)).astype(np.float32)}
    for _ in range(3):
        instance.run(inputs)
    count, started = 0, time.perf_counter()
    while True:
        instance.run(inputs)  # outputs come back to the host, so each call includes its synchronisation
        count += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and count >= 3:
            return count * batch / elapsed


def run(
    *, batches: Sequence[int], rounds: int, seconds: float, threads: int, device: str, net: str = "refcnn"
) -> dict[str, dict[int, list[float]]]:
    """Every runner's items/s at every batch, `rounds` times (runners interleaved within each round)."""
    from services.model.backend import ModelBackend, ServiceSettings
    from services.model.tensorrt import tensorrt_status

    runners = dict(RUNNERS)
    if device.startswith("cuda") and tensorrt_status()[0]:
        runners.update(GPU_RUNNERS)
    figures: dict[str, dict[int, list[float]]] = {label: {b: [] for b in batches} for label in runners}
    with tempfile.TemporaryDirectory(prefix="model-bench-") as tmp:
        root = Path(tmp)
        names = write_models(root, max(batches), runners, net)
        shape = network(net)[1]
        # Strict: a runner that cannot load fails the benchmark rather than have another's figures.
        backend = ModelBackend(
            ServiceSettings(
                device=device, threads=threads, engine_cache=root / ".engines", strict_runner=True
            )
        )
        repository = ModelRepository(root)
        instances = {}
        for label, name in names.items():
            version = "1"
            if label in INT8:
                samples = root / "calibration.npy"
                np.save(samples, np.random.default_rng(0).standard_normal((64, *shape)).astype(np.float32))
                version = quantize(root, name, QuantizeSettings(calibration=samples, runs=3)).version
            instance = backend.prepare(repository.read(name), version).instances[0]
            instance.load()
            instances[label] = instance
            print(f"{label:12} {instance.reason}", flush=True)
        for round_ in range(rounds):
            for batch in batches:
                for label, instance in instances.items():
                    figures[label][batch].append(measure(instance, batch, seconds, shape))
            print(f"round {round_ + 1}/{rounds} done", flush=True)
        for instance in instances.values():
            instance.unload()
    return figures


def report(figures: dict[str, dict[int, list[float]]], batches: Sequence[int]) -> list[str]:
    """The table: median items/s per runner and batch (every round's figure in brackets), and the ratio of
    ONNX Runtime (and TensorRT FP16, on a GPU) to the faster FP32 PyTorch runner."""
    labels = list(figures)
    trt = "tensorrt fp16" in figures
    lines = [
        "batch | "
        + " | ".join(f"{label} items/s" for label in labels)
        + " | onnxruntime / best torch"
        + (" | tensorrt fp16 / best torch" if trt else "")
    ]
    for batch in batches:
        medians = {label: statistics.median(figures[label][batch]) for label in labels}
        cells = [
            f"{medians[label]:,.0f} ({', '.join(f'{v:,.0f}' for v in figures[label][batch])})"
            for label in labels
        ]
        torch_best = max(v for k, v in medians.items() if k in ("torch (pt)", "torch (pt2)"))
        ratios = f" | {medians['onnxruntime'] / torch_best:.2f}"
        if trt:
            ratios += f" | {medians['tensorrt fp16'] / torch_best:.2f}"
        lines.append(f"{batch} | " + " | ".join(cells) + ratios)
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, measure, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.runners", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3, help="measurements per figure; default %(default)s")
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement; default %(default)s")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads per runner; default %(default)s"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    parser.add_argument("--network", choices=NETWORKS, default="refcnn", help="default %(default)s")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if min(args.batches) < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("batches, rounds and threads must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    import onnxruntime
    import torch

    print(
        f"{args.network} on {args.device}: torch {torch.__version__}, ONNX Runtime {onnxruntime.__version__}, "
        f"{args.threads} intra-op thread(s), {args.rounds} round(s) of {args.seconds:g} s per figure",
        flush=True,
    )
    figures = run(
        batches=args.batches,
        rounds=args.rounds,
        seconds=args.seconds,
        threads=args.threads,
        device=args.device,
        net=args.network,
    )
    for line in report(figures, args.batches):
        print(line)
    if args.json:
        args.json.write_text(
            json.dumps({k: {str(b): v for b, v in f.items()} for k, f in figures.items()}, indent=1)
        )


if __name__ == "__main__":
    main()
