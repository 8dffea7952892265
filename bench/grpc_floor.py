"""What one Python gRPC call costs on this machine, with nothing of ours in it: `python -m bench.grpc_floor`.

A bare grpc.aio server answering `ModelInfer` with its input (no validation, no model), in a process of its
own, and a grpc.aio client calling it closed-loop. It prints the calls per second and the CPU each call
costs the server process and the client process. Every hop of the pipeline pays at least this much, so it is
the floor under the pipeline's CPU per request: the router serves one call per request and makes one stage
call per batch per step; each stage serves one call per batch.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time
from collections.abc import Sequence

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc


class _Echo(pb_grpc.GRPCInferenceServiceServicer):
    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext):
        return pb.ModelInferResponse(
            model_name=request.model_name, raw_output_contents=request.raw_input_contents
        )


def _serve(ports: multiprocessing.Queue) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(address: str, calls: int, concurrency: int, payload: bytes) -> tuple[float, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="echo", raw_input_contents=[payload])
        for _ in range(50):  # warm the connection
            await stub.ModelInfer(request)
        left = calls

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await stub.ModelInfer(request)

        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--payload-bytes", type=int, default=12_288, help="default: one refcnn image")
    args = parser.parse_args(argv)
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=30)}"
        print(f"load average {os.getloadavg()[0]:.2f}; {args.payload_bytes} bytes a call")
        print("| concurrency | calls/s | server µs CPU per call | client µs CPU per call |")
        print("|---:|---:|---:|---:|")
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            before = _cpu_seconds(server.pid)  # type: ignore[arg-type]
            wall, client = asyncio.run(_load(address, args.calls, concurrency, b"\0" * args.payload_bytes))
            served = _cpu_seconds(server.pid) - before  # type: ignore[arg-type]
            print(
                f"| {concurrency} | {args.calls / wall:,.0f} | {served / args.calls * 1e6:,.0f} | "
                f"{client / args.calls * 1e6:,.0f} |",
                flush=True,
            )
    finally:
        server.kill()


if __name__ == "__main__":
    main()
