"""CPU that one request of many large images buys from `digits_preprocess`: `python -m bench.hardening_pixels`.

One ModelInfer of `--images` PNGs of `--size`² RGBA pixels (each under the per-image cap; a few MB in all)
goes straight to a stage service serving the example repository's `digits_preprocess`, with a deadline of
`--deadline` seconds. The figures are the answer's status and time, how long the stage's instance stays busy
(a small request sent right after is answered once it is free), and the process's CPU seconds until then.

Two settings of the stage: its pixel budget lifted (`max_batch_pixels` far above the batch, so only the
deadline stops the work), and its configured budget, which refuses the images past it from their headers. A
tree without deadlines and budgets decodes every image whatever the setting.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
from PIL import Image, ImageDraw

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_stages

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
MODEL = "digits_preprocess"
#: A budget far above any batch here: only the deadline can stop the work.
LIFTED = 10**15


def big_png(size: int) -> bytes:
    """A `size`² RGBA PNG of a digit-like stroke: a few kB that decode to `size`² pixels."""
    image = Image.new("RGBA", (size, size), (255, 255, 255, 255))
    ImageDraw.Draw(image).ellipse(
        (size // 4, size // 8, 3 * size // 4, 7 * size // 8), outline="black", width=size // 12
    )
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def request(images: Sequence[bytes]) -> pb.ModelInferRequest:
    array = np.empty((len(images), 1), dtype=object)
    for i, data in enumerate(images):
        array[i, 0] = data
    tensor = Tensor.from_array("IMAGE", array)
    message = pb.ModelInferRequest(model_name=MODEL)
    message.inputs.add(name="IMAGE", datatype="BYTES", shape=list(tensor.shape))
    message.raw_input_contents.append(tensor.raw)
    return message


def repository(root: Path, max_batch_pixels: int | None) -> Path:
    """A repository holding the example `digits_preprocess`, its budget lifted when asked."""
    shutil.copytree(REPOSITORY / MODEL, root / MODEL, ignore=shutil.ignore_patterns("__pycache__"))
    if max_batch_pixels is not None:
        config = root / MODEL / "config.pbtxt"
        text = config.read_text().replace('"64000000"', f'"{max_batch_pixels}"')
        config.write_text(text)
    return root


async def measure(root: Path, images: Sequence[bytes], deadline: float) -> dict[str, object]:
    small = request([big_png(64)])
    async with (
        serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage,
        grpc.aio.insecure_channel(
            stage.address, options=[("grpc.max_send_message_length", 256 << 20)]
        ) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while not (await stub.ModelReady(pb.ModelReadyRequest(name=MODEL), wait_for_ready=True)).ready:
            await asyncio.sleep(0.05)  # loading
        await stub.ModelInfer(small, timeout=60)  # warm
        cpu, start = time.process_time(), time.perf_counter()
        try:
            await stub.ModelInfer(request(images), timeout=deadline)
            status = "OK"
        except grpc.aio.AioRpcError as err:
            status = err.code().name
        answered = time.perf_counter() - start
        await stub.ModelInfer(small, timeout=600)  # runs once the instance is free
        return {
            "status": status,
            "answered_s": answered,
            "busy_s": time.perf_counter() - start,
            "cpu_s": time.process_time() - cpu,
        }


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hardening_pixels", description=__doc__)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=4000)
    parser.add_argument("--deadline", type=float, default=1.0)
    args = parser.parse_args(argv)
    png = big_png(args.size)
    images = [png] * args.images
    print(
        f"{args.images} PNGs of {args.size}x{args.size} RGBA, {len(png) * args.images / 1e6:.1f} MB in all, "
        f"deadline {args.deadline:g} s"
    )
    for label, budget in (("budget lifted", LIFTED), ("configured budget", None)):
        with tempfile.TemporaryDirectory() as folder:
            figures = await measure(repository(Path(folder), budget), images, args.deadline)
        print(
            f"  {label:18} answer {figures['status']} after {figures['answered_s']:.2f} s; instance busy "
            f"{figures['busy_s']:.2f} s; CPU {figures['cpu_s']:.2f} s"
        )


if __name__ == "__main__":
    asyncio.run(main())
