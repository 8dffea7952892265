"""What one Python gRPC call costs on this machine, with nothing of ours in it: `python -m bench.grpc_floor`.

A bare server answering `ModelInfer` (or each message of `ModelStreamInfer`) with its input (no
validation, no model), in a process of its own, and a grpc.aio client calling it closed-loop. It prints the
calls per second and the CPU each call costs the server process and the client process, for each server
flavour: grpc.aio on asyncio's default loop, grpc.aio on uvloop, the synchronous `grpc.server` with a thread
pool, and grpc.aio on uvloop answering one long-lived `ModelStreamInfer` stream per client worker. Every hop
of the pipeline pays at least this much, so it is the floor under the pipeline's CPU per request: the router
serves one call per request and makes one stage call per batch per step; each stage serves one call per batch.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
import uvloop

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

#: The server flavours measured, in the order printed.
FLAVOURS = ("aio", "aio-uvloop", "sync-threads", "aio-uvloop-stream")


def _echo(request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    return pb.ModelInferResponse(
        model_name=request.model_name, id=request.id, raw_output_contents=request.raw_input_contents
    )


class _AsyncEcho(pb_grpc.GRPCInferenceServiceServicer):
    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext):
        return _echo(request)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        async for request in requests:
            yield pb.ModelStreamInferResponse(infer_response=_echo(request))


class _SyncEcho(pb_grpc.GRPCInferenceServiceServicer):
    def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.ServicerContext):
        return _echo(request)

    def ModelStreamInfer(
        self, requests: Iterator[pb.ModelInferRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ModelStreamInferResponse]:
        for request in requests:
            yield pb.ModelStreamInferResponse(infer_response=_echo(request))


def _serve(flavour: str, ports: multiprocessing.Queue) -> None:
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    if flavour == "sync-threads":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=options)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(_SyncEcho(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        server.wait_for_termination()
        return

    async def main() -> None:
        server = grpc.aio.server(options=options)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(_AsyncEcho(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    if flavour == "aio":
        asyncio.run(main())
    else:
        uvloop.run(main())


def cpu_seconds(pid: int) -> float:
    """The user and system CPU a process has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _unary(stub: pb_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest, count: int) -> None:
    for _ in range(count):
        await stub.ModelInfer(request)


async def _stream(stub: pb_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest, count: int) -> None:
    call = stub.ModelStreamInfer()
    for _ in range(count):  # one message in flight on each stream
        await call.write(request)
        await call.read()
    await call.done_writing()


async def _load(
    address: str, flavour: str, calls: int, concurrency: int, payload: bytes
) -> tuple[float, float]:
    call = _stream if flavour.endswith("stream") else _unary
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="echo", raw_input_contents=[payload])
        await call(stub, request, 50)  # warm the connection
        share = calls // concurrency
        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(call(stub, request, share) for _ in range(concurrency)))
        return time.perf_counter() - wall, time.process_time() - cpu


@dataclass(frozen=True, slots=True)
class Floor:
    """One flavour at one concurrency: calls per second and CPU µs per call in server and client."""

    flavour: str
    concurrency: int
    calls_per_s: float
    server_us: float
    client_us: float


def measure(flavour: str, concurrency: int, calls: int = 4000, payload_bytes: int = 12_288) -> Floor:
    """Start a bare server of `flavour`, load it closed-loop from this process (grpc.aio on uvloop), stop it."""
    # A fresh interpreter: no gRPC state (or loop) of this process's is inherited.
    spawn = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue = spawn.Queue()
    server = spawn.Process(target=_serve, args=(flavour, ports), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=60)}"
        before = cpu_seconds(server.pid)  # type: ignore[arg-type]
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        with runner:
            wall, client = runner.run(_load(address, flavour, calls, concurrency, b"\0" * payload_bytes))
        served = cpu_seconds(server.pid) - before  # type: ignore[arg-type]
        done = calls // concurrency * concurrency
        return Floor(flavour, concurrency, done / wall, served / done * 1e6, client / done * 1e6)
    finally:
        server.kill()
        server.join()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--payload-bytes", type=int, default=12_288, help="default: one refcnn image")
    parser.add_argument("--flavours", default=",".join(FLAVOURS), help=f"any of {', '.join(FLAVOURS)}")
    args = parser.parse_args(argv)
    print(
        f"load average {os.getloadavg()[0]:.2f}; {args.payload_bytes} bytes a call; a grpc.aio client on uvloop"
    )
    print("| server | concurrency | calls/s | server µs CPU per call | client µs CPU per call |")
    print("|---|---:|---:|---:|---:|")
    for flavour in args.flavours.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            floor = measure(flavour, concurrency, args.calls, args.payload_bytes)
            print(
                f"| {flavour} | {concurrency} | {floor.calls_per_s:,.0f} | {floor.server_us:,.0f} | "
                f"{floor.client_us:,.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
