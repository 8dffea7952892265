"""What the router asks a stage about its models: a model's interface, and the models a replica serves.

The interface comes from the model's `ModelMetadata` and, where the stage has it, Triton's `ModelConfig`
(batching, padding, caching, decoupled, sequence batching); a plain OIP server without `ModelConfig` batches
where every tensor's shape leads with -1. A replica's `RepositoryIndex` tells which models it serves, as
replicas of one stage may serve different ones; where it writes a state other than Triton's, the model's
`ModelReady` says whether it is READY. A replica's `ModelStatistics` are its models' own figures.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import ModelSignature, StageEndpoint
from pipeline.protocol.codec import specs_from_metadata
from pipeline.protocol.errors import StageError, Unavailable
from pipeline.protocol.model_config import batching_of_config, is_deterministic, pad_values
from pipeline.runtime.metrics import Metrics

if TYPE_CHECKING:
    from pipeline.router.stages.replicas import Replica

log = logging.getLogger(__name__)

#: The states Triton writes in a `RepositoryIndex`. Other servers write others (MLServer 1.7: "State.READY"),
#: which say nothing sure: the replica's `ModelReady` is asked instead.
MODEL_STATES = frozenset({"UNKNOWN", "READY", "UNAVAILABLE", "LOADING", "UNLOADING"})


class SupportsStageQueries(Protocol):
    """What these questions need of a stage's client (`pipeline.router.stages.stage_client.StageClient`)."""

    endpoint: StageEndpoint
    metrics: Metrics | None

    @property
    def auth(self) -> tuple[tuple[str, str], ...]: ...

    async def call(self, method: str, request: object, *, timeout: float | None, what: str) -> Any: ...


async def replica_index(
    client: SupportsStageQueries, replica: Replica, *, ready_only: bool
) -> list[pb.RepositoryIndexResponse.ModelIndex] | None:
    """One replica's `RepositoryIndex` (None where its server has none); `Unavailable` where it cannot
    answer now, `StageError` for another failure. Replicas of a stage may serve different models, so each
    is asked for its own."""
    name = client.endpoint.name
    try:
        reply = await replica.stub.RepositoryIndex(
            pb.RepositoryIndexRequest(ready=ready_only), timeout=2.0, metadata=client.auth
        )
    except grpc.aio.AioRpcError as err:
        code, details = err.code(), err.details() or ""
        if client.metrics is not None:
            client.metrics.stage_calls.labels(name, code.name).inc()
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return None
        where = f"stage '{name}' ({replica.address})"
        if code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ):
            raise Unavailable(f"{where} is unavailable for its repository index: {details}") from None
        raise StageError(f"the repository index of {where}: {details}", code) from None
    if client.metrics is not None:
        client.metrics.stage_calls.labels(name, "OK").inc()
    models = list(reply.models)
    unclear = [m for m in models if m.state not in MODEL_STATES]
    if unclear:
        await asyncio.gather(*(_confirm_ready(client, replica, m) for m in unclear))
    return models


async def _confirm_ready(
    client: SupportsStageQueries, replica: Replica, model: pb.RepositoryIndexResponse.ModelIndex
) -> None:
    """Mark an index entry whose state is not one of Triton's (MLServer 1.7 writes "State.READY") READY where
    the replica's `ModelReady` says the model version is; it keeps the state it had otherwise, or where the
    replica cannot answer now."""
    try:
        reply = await replica.stub.ModelReady(
            pb.ModelReadyRequest(name=model.name, version=model.version), timeout=2.0, metadata=client.auth
        )
    except grpc.aio.AioRpcError as err:
        if client.metrics is not None:
            client.metrics.stage_calls.labels(client.endpoint.name, err.code().name).inc()
        return
    if client.metrics is not None:
        client.metrics.stage_calls.labels(client.endpoint.name, "OK").inc()
    if reply.ready:
        model.state = "READY"


async def replica_statistics(
    client: SupportsStageQueries, replica: Replica, name: str, version: str
) -> list[pb.ModelStatistics]:
    """One replica's own `ModelStatistics` of `name` (every model where ""), at `version`; none where it
    cannot give them (no `ModelStatistics`, as a plain OIP server or MLServer; a model it does not serve; or
    it cannot answer now)."""
    try:
        reply = await replica.stub.ModelStatistics(
            pb.ModelStatisticsRequest(name=name, version=version), timeout=2.0, metadata=client.auth
        )
    except grpc.aio.AioRpcError as err:
        # NOTE: not counted in the stage calls' metric: a scrape of Triton's metrics asks for statistics.
        log.debug(
            "stage '%s' (%s) gives no statistics of '%s': %s",
            client.endpoint.name,
            replica.address,
            name,
            err.details(),
        )
        return []
    return list(reply.model_stats)


async def model_signature(client: SupportsStageQueries, model: str) -> ModelSignature:
    """A model's interface, from its `ModelMetadata` and (where the stage has it) Triton's `ModelConfig`."""
    what = f"model '{model}'"
    meta = await client.call("ModelMetadata", pb.ModelMetadataRequest(name=model), timeout=2.0, what=what)
    inputs, outputs = specs_from_metadata(meta.inputs), specs_from_metadata(meta.outputs)
    cache, deterministic, decoupled, sequence = False, True, False, False
    try:
        reply = await client.call("ModelConfig", pb.ModelConfigRequest(name=model), timeout=2.0, what=what)
        cache, deterministic = reply.config.response_cache.enable, is_deterministic(reply.config)
        decoupled = reply.config.model_transaction_policy.decoupled
        sequence = reply.config.HasField("sequence_batching")
        max_batch_size = reply.config.max_batch_size
        padding = pad_values(reply.config)
        inputs = tuple(replace(s, pad_value=padding.get(s.name)) for s in inputs)
        outputs = tuple(replace(s, pad_value=padding.get(s.name)) for s in outputs)
        try:
            batching = batching_of_config(reply.config)
        except ValueError as exc:
            log.warning(
                "model '%s' on stage '%s': ignoring its dynamic_batching: %s",
                model,
                client.endpoint.name,
                exc,
            )
            batching = None
    except StageError as err:
        if err.code != grpc.StatusCode.UNIMPLEMENTED:
            raise
        # A plain OIP server without Triton's ModelConfig: a leading -1 everywhere means it batches.
        batches = all(spec.shape[:1] == (-1,) for spec in (*inputs, *outputs))
        max_batch_size = sys.maxsize if batches else 0
        batching = None
    return ModelSignature(
        model,
        inputs,
        outputs,
        max_batch_size,
        batching,
        tuple(meta.versions),
        cache,
        deterministic,
        decoupled,
        sequence,
    )
