"""What every server does, free of gRPC types: the `DataPlane` a stage service and the router implement,
and the `RequestContext` of the call each of its methods serves. A server's `InferenceHandler`
(`pipeline.runtime.handler`) runs its inference over the plane; the doors (the gRPC servicer,
`pipeline.runtime.servicer`; the frame port, `pipeline.transport.frame_server`; the router's HTTP/REST) adapt
their transport to the handler and the plane."""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Collection, Mapping
from dataclasses import dataclass

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import Unimplemented
from pipeline.protocol.frames import failed_requests
from pipeline.protocol.streams import STREAM_STATUS_EXTENSION
from pipeline.runtime.security import DOOR_HEADER, IDENTITIES_HEADER
from pipeline.runtime.shared_memory import EXTENSION as SHARED_MEMORY_EXTENSION

#: Metadata keys that belong to one hop and are not passed on to the next. The client's credentials are
#: the router's to check; the router calls its stages with credentials of its own (its stage token or its
#: client certificate), so a client's token never travels further.
_HOP_HEADERS = frozenset(
    {
        "user-agent",
        "content-type",
        "te",
        "grpc-timeout",
        "grpc-encoding",
        "host",
        "authorization",
        DOOR_HEADER,
        IDENTITIES_HEADER,
    }
)


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the data plane needs of the incoming call: its time left and the client's metadata."""

    timeout: float | None
    metadata: tuple[tuple[str, str | bytes], ...]
    #: How many clients' requests the call carries: more than one where the compiled front merged them into
    #: one (`pipeline.protocol.frames.MERGED_PARAMETER`); statistics and metrics count each.
    requests: int = 1
    #: Whether the compiled front batches this model's requests itself (its door, for a model or ensemble it may
    #: merge: `DataPlane.front_batch`). An ensemble's batchers are then not told of the request ahead of its steps
    #: (`batch_upcoming`): the front holds the next batch until one comes back, and a stage that waited for
    #: another of the front's batches would only make the batches at the router take turns through the stages.
    front_batched: bool = False

    def failures(self, outcome: str) -> int:
        """How many failed requests a call that failed with `outcome` (a status code's name) counts: none for
        merged requests that the front sends again each alone (`RESEND_CODES`), each counted as it fares."""
        return failed_requests(self.requests, outcome)

    @classmethod
    def of(cls, context: grpc.aio.ServicerContext, *, credentials: bool = False) -> RequestContext:
        """The call's time left and metadata; its `authorization` too with `credentials` (a repository change
        at the router, which the stages check as well), else never passed on."""
        metadata = tuple(
            (key, value)
            for key, value in (context.invocation_metadata() or ())
            if not key.startswith(":")
            and (key not in _HOP_HEADERS or (credentials and key == "authorization"))
        )
        return cls(context.time_remaining(), metadata)


class DataPlane(abc.ABC):
    """What a server does, free of gRPC types: model lookup, metadata, configuration and inference."""

    #: `ServerMetadata.extensions`: the protocol extensions this server supports.
    extensions: tuple[str, ...] = (
        "model_configuration",
        "statistics",
        SHARED_MEMORY_EXTENSION,
        STREAM_STATUS_EXTENSION,
    )

    #: The models that answer a request with any number of responses (decoupled), by name: served by
    #: `stream`, on streams only. Empty on a server that has none, which costs ordinary requests one check.
    decoupled: Collection[str] = frozenset()

    def front_batch(self, model: str) -> int:
        """The most items the compiled front (`pipeline.router.front`) may merge requests of `model` (an ensemble
        or a model) into one request with; 0 (the default): it merges none."""
        return 0

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether every model is ready to serve."""

    @abc.abstractmethod
    async def model_ready(self, name: str, version: str) -> bool:
        """Whether a model (at a version, or its default one) is ready."""

    @abc.abstractmethod
    async def model_metadata(self, name: str, version: str, call: RequestContext) -> pb.ModelMetadataResponse:
        """`ModelMetadata` of a model; raises `ModelNotFound`."""

    @abc.abstractmethod
    async def model_config(self, name: str, version: str, call: RequestContext) -> mc.ModelConfig:
        """Triton's `ModelConfig` of a model; raises `ModelNotFound`."""

    @abc.abstractmethod
    async def infer(self, request: pb.ModelInferRequest, call: RequestContext) -> pb.ModelInferResponse:
        """Run one inference request."""

    def stream(
        self, request: pb.ModelInferRequest, call: RequestContext
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """A decoupled model's responses to one request as they come (an error is a response of its own),
        the last marked final (`pipeline.protocol.streams.set_final`), a final flag sent alone as a
        response without outputs. Only for the models in `decoupled`."""
        raise Unimplemented("this server has no decoupled models")

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """Triton's `ModelStatistics`: every model's counters, or one model's (`name`)."""
        raise Unimplemented("this server keeps no statistics")

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """Triton's `RepositoryIndex`: every model (version) in the repository and its state."""
        raise Unimplemented("this server has no model repository")

    async def repository_load(
        self, name: str, parameters: Mapping[str, object], call: RequestContext
    ) -> None:
        """Triton's `RepositoryModelLoad`: load or reload a model (`call`: the caller's time and metadata)."""
        raise Unimplemented("this server has no model repository")

    async def repository_unload(
        self, name: str, parameters: Mapping[str, object], call: RequestContext
    ) -> None:
        """Triton's `RepositoryModelUnload`: stop serving a model."""
        raise Unimplemented("this server has no model repository")
