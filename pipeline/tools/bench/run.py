"""A whole `pipeline bench` run: read the model's metadata, build the payloads, run every level and collect
the client's and the server's figures."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import Tensor
from pipeline.tools.bench.endpoints import Call, EndpointError, GrpcEndpoint, HttpEndpoint
from pipeline.tools.bench.load import Tally, arrivals, drive, share
from pipeline.tools.bench.options import BenchError, BenchOptions, Level
from pipeline.tools.bench.payloads import Payloads, build_request, synthesize_inputs
from pipeline.tools.bench.processes import LoadPool
from pipeline.tools.bench.progress import Progress
from pipeline.tools.bench.report import BenchReport, LevelResult
from pipeline.tools.bench.statistics import STATISTICS_EXTENSION, cpu_over, statistics_over
from pipeline.tools.client import EMPTY_FINAL_RESPONSE


async def _server_info(endpoint: GrpcEndpoint | HttpEndpoint, model: str, version: str) -> tuple:
    """The server's and the model's metadata, and whether the model batches (dim 0 is the batch)."""
    try:
        server = await endpoint.server_metadata()
        metadata = await endpoint.model_metadata(model, version)
    except EndpointError as err:
        raise BenchError(f"cannot read the metadata of '{model}': {err.code}: {err.message}") from None
    batching: bool | None = None
    with contextlib.suppress(EndpointError):  # ModelConfig is Triton's extension, not core OIP
        config = await endpoint.model_config(model, version)
        batching = config.max_batch_size > 0
    if batching is None:
        batching = bool(metadata.inputs) and all(t.shape and t.shape[0] == -1 for t in metadata.inputs)
    return server, metadata, batching


def _payloads(
    options: BenchOptions,
    endpoint: GrpcEndpoint | HttpEndpoint,
    metadata: pb.ModelMetadataResponse,
    batching: bool,
) -> tuple[Payloads, dict[str, np.ndarray]]:
    """What the load sends (a request per turn of the input files), and the inputs of the last request."""
    turns = max((len(paths) for paths in options.input_files.values()), default=1)
    requests = []
    for turn in range(turns):
        arrays = synthesize_inputs(
            metadata,
            batching=batching,
            batch=options.batch,
            shapes=options.shapes,
            files={name: paths[turn % len(paths)] for name, paths in options.input_files.items()},
            values=options.values,
            seed=options.seed,
        )
        request = build_request(options.model, options.model_version, arrays)
        if options.stream:  # the end of every request is flagged, even when its last response is empty
            request.parameters[EMPTY_FINAL_RESPONSE].bool_param = True
        requests.append(endpoint.payload(request))
    if (
        options.repeat_share is not None
        and len(requests[0] if isinstance(requests[0], bytes) else requests[0][0]) < 8
    ):
        raise BenchError("--repeat-share needs requests of at least 8 bytes of input data")
    return Payloads(requests, options.repeat_share, options.seed), arrays


async def run_bench(options: BenchOptions) -> BenchReport:
    """Measure every level of `options` and return the report (nothing printed but the progress bar)."""
    options.check()
    endpoint = options.endpoint()
    try:
        server, metadata, batching = await _server_info(endpoint, options.model, options.model_version)
        payload, arrays = _payloads(options, endpoint, metadata, batching)
        batch = options.batch if batching else 1
        with_stats = STATISTICS_EXTENSION in server.extensions
        server_info = {
            "name": server.name,
            "version": server.version,
            "extensions": list(server.extensions),
            "statistics": with_stats,
        }
        inputs = [
            {"name": name, "datatype": Tensor.from_array(name, a).datatype, "shape": list(a.shape)}
            for name, a in arrays.items()
        ]
        call = options.call(endpoint)
        pool = LoadPool(options.processes, options, payload) if options.processes > 1 else None
        try:
            if pool is not None:
                await pool.ready()
            results = []
            levels = options.levels()
            with Progress(options, levels) as progress:
                for i, level in enumerate(levels):
                    result = await _run_level(
                        options, level, call, payload, endpoint if with_stats else None, pool, progress, i
                    )
                    result.batch = batch
                    results.append(result)
        finally:
            if pool is not None:
                pool.close()
    except OSError as err:  # the server cannot be reached at all
        raise BenchError(f"cannot reach {options.url} over {options.protocol}: {err}") from None
    finally:
        await endpoint.close()
    return BenchReport(options, server_info, inputs, results)


async def _run_level(
    options: BenchOptions,
    level: Level,
    call: Call,
    payload: Any,
    stats_endpoint: GrpcEndpoint | HttpEndpoint | None,
    pool: LoadPool | None,
    progress: Progress,
    index: int,
) -> LevelResult:
    """One level: the load, here or over the load processes, and the server's figures over its measured
    interval, read meanwhile."""
    lead = 0.2 if pool is not None else 0.0  # time for every process to receive its orders
    start = time.perf_counter() + lead
    t_meas, t_stop = start + options.warmup, start + options.warmup + options.duration
    open_level = arrivals(level, options.arrival)
    kwargs: dict[str, Any] = {
        "warmup": options.warmup,
        "duration": options.duration,
        "timeout": options.timeout,
        "max_inflight": options.max_inflight,
    }
    tally = Tally()

    def settled() -> bool:
        # Responses still in flight at the end belong to the interval by the server's clock: wait for them.
        return pool is not None or tally.sent <= tally.ok + sum(tally.errors.values())

    stats_task = asyncio.create_task(_server_statistics(stats_endpoint, t_meas, t_stop, settled))
    cpu_task = asyncio.create_task(cpu_over(options.cpu_metrics, t_meas, t_stop))
    ticker = asyncio.create_task(progress.follow(index, start, tally if pool is None else None))
    try:
        if pool is None:
            await drive(call, payload, open_level, start=start, seed=options.seed, tally=tally, **kwargs)
            raws = [tally.raw()]
        else:
            shares = share(open_level, options.processes)
            start_wall = time.time() + lead
            raws = await pool.run(shares, start_wall, {**kwargs, "seed": options.seed})
        stages, stages_error = await stats_task
        cpu_seconds = await cpu_task
    finally:
        ticker.cancel()
        stats_task.cancel()
        cpu_task.cancel()
    result = LevelResult(
        level,
        options.duration,
        options.batch,
        stages=stages,
        cpu_seconds=cpu_seconds,
        streamed=options.stream,
    )
    result.stages_error = stages_error
    return _counted(result, raws)


async def _server_statistics(
    endpoint: GrpcEndpoint | HttpEndpoint | None, t_meas: float, t_stop: float, settled: Callable[[], bool]
) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """The server's figures over the measured interval (none without an endpoint), or why they are missing:
    the load goes on without them."""
    if endpoint is None:
        return None, None
    try:
        return await statistics_over(endpoint, t_meas, t_stop, settled), None
    except EndpointError as err:
        return None, f"ModelStatistics failed: {err.code}: {err.message}"


def _counted(result: LevelResult, raws: list[dict[str, Any]]) -> LevelResult:
    """`result` with the counts and latencies of every load process's tally (`Tally.raw`) added up."""
    for raw in raws:
        result.sent += raw["sent"]
        result.ok += raw["ok"]
        result.dropped += raw["dropped"]
        result.errors.update(raw["errors"])
        result.window_errors.update(raw["window_errors"])
        result.stream_responses += raw["streamed"]
    result.latencies = np.sort(np.concatenate([raw["latencies"] for raw in raws]))
    result.first_response = np.sort(np.concatenate([raw["firsts"] for raw in raws]))
    result.gaps = np.sort(np.concatenate([raw["gaps"] for raw in raws]))
    result.window_ok = int(result.latencies.size)
    return result
