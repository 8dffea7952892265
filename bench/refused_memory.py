"""The router's resident memory around refused model loads: before, just after, and once it has been idle.

    python -m bench.refused_memory [--loads 20] [--mb 40] [--idle 15]

Starts `pipeline run` (Python front door, so the router process is the one that reads the requests) on a
repository of one Python model with model control off, sends `--loads` `RepositoryModelLoad` requests, each
carrying a `--mb` MB file override, all refused (FAILED_PRECONDITION), and prints the router's resident MB
before, right after, and after `--idle` seconds without requests (an idle server gives back what its
allocator kept: `pipeline.runtime.allocator.give_back_when_idle`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import grpc

from bench.running import Pipeline
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""
MODEL = """import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests
        ]
"""


def resident_mb(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * 4096 >> 20


async def refuse(address: str, pid: int, loads: int, mb: int, idle: float) -> dict[str, object]:
    options = [("grpc.max_send_message_length", (mb + 1) << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        before, codes = resident_mb(pid), set()
        for _ in range(loads):
            request = pb.RepositoryModelLoadRequest(model_name="echo")
            request.parameters["file:1/model.py"].bytes_param = b"x" * (mb << 20)
            try:
                await stub.RepositoryModelLoad(request, timeout=60)
                codes.add("OK")
            except grpc.aio.AioRpcError as err:
                codes.add(err.code().name)
        after = resident_mb(pid)
        await asyncio.sleep(idle)
        return {"answers": sorted(codes), "before_mb": before, "after_mb": after, "idle_mb": resident_mb(pid)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=20, help="refused loads sent one after the other")
    parser.add_argument("--mb", type=int, default=40, help="MB of each load's file override")
    parser.add_argument("--idle", type=float, default=15.0, help="seconds idle before the last reading")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="refused-memory-") as scratch:
        root = Path(scratch) / "models"
        (root / "echo" / "1").mkdir(parents=True)
        (root / "echo" / "config.pbtxt").write_text(CONFIG)
        (root / "echo" / "1" / "model.py").write_text(MODEL)
        pipeline = Pipeline(root, Path(scratch) / "pipeline.log", env={"PIPELINE_FRONT": "python"})
        try:
            result = asyncio.run(
                refuse(pipeline.router, pipeline.pids["router"], args.loads, args.mb, args.idle)
            )
        finally:
            pipeline.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
