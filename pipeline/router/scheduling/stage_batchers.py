"""The batchers of the batched stage models: made once per model as its config (or an ensemble) says, their
calls queued and merged into one `ModelInfer` per batch, split back by offsets
(`pipeline.router.scheduling.merge`); an item the stage refuses fails only the request that carried it.

The dispatcher (`pipeline.router.scheduling.dispatch`) owns them, and decides which calls queue here. A model
loaded again through the router with another signature is batched as it says from then on (`refit`).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from opentelemetry.trace import Span

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import describe_batching, stated_batching
from pipeline.ensemble.plan import EnsemblePlan, ModelSignature
from pipeline.protocol.call_chain import CALL_CHAIN_HEADER, CallChain
from pipeline.protocol.codec import Tensor, response_tensors
from pipeline.protocol.errors import ConfigError, DeadlineExceeded, InvalidInput, ItemError, StageError
from pipeline.protocol.parameters import int_parameter
from pipeline.protocol.types import BatchingConfig
from pipeline.router.caching.cache_policy import ResponseCaching
from pipeline.router.registry import ModelRegistry
from pipeline.router.scheduling.batching import DynamicBatcher, priority_index
from pipeline.router.scheduling.merge import BatchMember, TensorBatching
from pipeline.router.stages.stage_client import StageClient
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import CONFIG_FILE
from pipeline.runtime.telemetry import PEER, STAGE, Telemetry

log = logging.getLogger(__name__)

#: A batched stage model's batcher, and how its requests' tensors merge into a batch and split back.
Batched = tuple[DynamicBatcher[BatchMember, dict[str, Tensor]], TensorBatching]


class StageBatchers:
    """The batcher of each batched stage model: made, fed and stopped here.

    The models' signatures are the `registry`'s, and a batcher's statistics become the model's there;
    `caching` hears which version answered each batch."""

    def __init__(
        self, registry: ModelRegistry, caching: ResponseCaching, *, telemetry: Telemetry, metrics: Metrics
    ) -> None:
        self.registry = registry
        self.caching = caching
        self.telemetry = telemetry
        self.metrics = metrics
        #: Batched stage model -> its batcher.
        self.batchers: dict[str, Batched] = {}
        #: The batchers that gave way to new ones (`refit`), sending what they hold.
        self._draining: set[asyncio.Task[None]] = set()
        self._export_gauges(metrics)

    def _export_gauges(self, metrics: Metrics) -> None:
        batchers = self.batchers
        metrics.gauge(
            "pipeline_queue_depth",
            "Requests waiting now",
            "model",
            lambda: [(model, b.queue_depth) for model, (b, _) in batchers.items()],
        )
        metrics.gauge(
            "pipeline_inflight_batches",
            "Executions running now",
            "model",
            lambda: [(model, b.inflight_batches) for model, (b, _) in batchers.items()],
        )

    def batch_steps(
        self,
        plan: EnsemblePlan,
        clients: Mapping[str, StageClient],
        declared: Mapping[str, tuple[BatchingConfig | None, str]],
        repository: str = "",
    ) -> None:
        """Give the model of every batched step its one batcher (`clients`: each step's stage's), shared by
        every ensemble that calls it: as the model's own config says (`dynamic_batching` in its ModelConfig),
        else as an ensemble states it (`declared`: model -> the setting, None for off, and where it is
        stated), else none. Raises `ConfigError` for the ensemble where it states a setting that the model's
        own, or its batcher already running, disagrees with (`repository`: the router's model repository,
        where the message finds the model's config.pbtxt)."""
        errors: list[str] = []
        chosen: dict[str, BatchingConfig | None] = {}
        for step in sorted(plan.steps, key=lambda s: s.index):
            model = step.model_name
            own = self.registry.signatures[model].batching
            states, stated = stated_batching(step)
            where = f"{plan.source} ({step.label})"
            if states and own is not None and stated != own:
                config = Path(repository, model, CONFIG_FILE)
                file = str(config) if repository and config.is_file() else "its own config.pbtxt"
                errors.append(
                    f"{where}: model '{model}' has dynamic_batching {describe_batching(stated)} here but "
                    f"{describe_batching(own)} in {file} (its ModelConfig on stage '{step.stage}'); a model "
                    "has one batcher, so one setting: drop the ensemble's"
                )
                continue
            batching = own if own is not None else declared.get(model, (None, ""))[0]
            if batching is not None and self.registry.signatures[model].sequence:
                errors.append(
                    f"{where}: model '{model}' has sequence_batching (its ModelConfig on stage '{step.stage}'): "
                    "the stage that keeps each sequence's state batches its requests, so it takes no "
                    "dynamic_batching; drop the ensemble's"
                )
                continue
            running = self.batchers.get(model)
            if running is not None and running[0].config != batching:
                errors.append(
                    f"{where}: model '{model}' has dynamic_batching {describe_batching(batching)} here but its "
                    f"batcher runs with {describe_batching(running[0].config)}; a model's batcher is set once: "
                    "restart the router to change it"
                )
                continue
            chosen[model] = batching
        if errors:
            raise ConfigError("\n".join(errors))
        for step in plan.steps:
            batching = chosen[step.model_name]
            if batching is not None and step.model_name not in self.batchers:
                log.info("model '%s': batched with %s", step.model_name, batching)
                self.add(step.model_name, clients[step.stage], batching)

    def add(self, model: str, client: StageClient, config: BatchingConfig) -> None:
        """Queue the calls of `model` (on `client`'s stage) and send them as batches, as `config` says; raises
        `ConfigError` when the batches would be larger than the model takes."""
        signature = self.registry.signatures[model]
        if _too_large(config, signature):
            raise ConfigError(
                f"model '{model}': dynamic_batching max_batch_size {config.max_batch_size} is larger than the "
                f"stage model's own max_batch_size {signature.max_batch_size}"
            )
        tensors = TensorBatching(signature)
        name = f"stage '{client.endpoint.name}' (model '{model}')"

        async def execute(calls: Sequence[BatchMember]) -> list[dict[str, Tensor] | BaseException]:
            # The model's tensors as learnt now (`refit`), while this batcher is its batcher.
            current = self.batchers.get(model)
            now = current[1] if current is not None and current[0] is batcher else tensors
            return await self._execute_batch(model, client, now, calls)

        batcher: DynamicBatcher[BatchMember, dict[str, Tensor]] = DynamicBatcher(
            name,
            execute,
            config,
            telemetry=self.telemetry,
            metrics=self.metrics,
            model=model,
            replicas=lambda: client.replicas.serving(model),
        )
        client.replicas.listeners.append(batcher.replicas_changed)
        batcher.start()
        self.batchers[model] = (batcher, tensors)
        # NOTE: the model's requests are counted by its batcher from now on.
        self.registry.stats[model] = batcher.stats

    def refit(self, model: str, client: StageClient, config: BatchingConfig | None) -> None:
        """`model` was loaded again with another signature (learnt into the registry): its calls are merged
        and split as it says from now on. A batcher with settings other than `config` (None: the model is not
        batched now) gives way to one with them, after sending what it holds. A call announced to the old
        one (`expect`) and queued at the new one is not taken up there: its count never goes below zero."""
        current, signature = self.batchers.get(model), self.registry.signatures[model]
        if current is not None and current[0].config == config and not _too_large(config, signature):
            self.batchers[model] = (current[0], TensorBatching(signature))
            return
        if current is not None:
            old = current[0]
            del self.batchers[model]
            with contextlib.suppress(ValueError):
                client.replicas.listeners.remove(old.replicas_changed)
            draining = asyncio.create_task(old.drain())
            self._draining.add(draining)
            draining.add_done_callback(self._draining.discard)
        if config is not None:
            self.add(model, client, config)

    async def submit(
        self,
        model: str,
        stage_call: BatchMember,
        deadline: float | None,
        parameters: Mapping[str, pb.InferParameter],
        span: Span | None = None,
        *,
        expected: bool = False,
    ) -> dict[str, Tensor]:
        """Queue one request's call of a batched model and wait for its outputs; `parameters` may give its
        `priority` (else the call inherits its chain's) and queue `timeout`, `expected`: announced to the
        batcher by `expect()`."""
        batcher, tensors = self.batchers[model]
        try:
            requested = int_parameter(parameters, "priority") if parameters else None
            if requested is None and stage_call.chain is not None:
                requested = stage_call.chain.priority  # what the request whose model calls asked for
            priority = priority_index(batcher.config, requested)
            queue_deadline = batcher.deadline_of(
                deadline, int_parameter(parameters, "timeout") if parameters else None
            )
            key = tensors.key(stage_call)
        except BaseException:
            if expected:
                batcher.unexpect()
            raise
        return await batcher.submit(
            stage_call,
            size=stage_call.size,
            key=key,
            deadline=queue_deadline,
            priority=priority,
            span=span,
            expected=expected,
            requests=stage_call.requests,
        )

    async def _execute_batch(
        self, model: str, client: StageClient, tensors: TensorBatching, calls: Sequence[BatchMember]
    ) -> list[dict[str, Tensor] | BaseException]:
        """One stage call for a batch of requests; an item the stage refuses fails only its request."""
        request = pb.ModelInferRequest(model_name=model, model_version=calls[0].version)
        for tensor in tensors.merge(calls):
            request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            request.raw_input_contents.append(tensor.raw)
        for name in dict.fromkeys(name for call in calls for name in call.outputs):
            request.outputs.add(name=name)
        what = f"a batch of {len(calls)} requests for model '{model}'"
        metadata: Sequence[tuple[str, str | bytes]] = ()
        if self.telemetry.enabled:
            # The batcher made the batch span current: the stage continues it.
            span = self.telemetry.current_span()
            if span is not None:
                span.set_attributes({STAGE: client.endpoint.name, PEER: client.endpoint.address})
            metadata = self.telemetry.inject(())
        chain = CallChain.merged(call.chain for call in calls)
        if chain is not None:
            metadata = (*metadata, (CALL_CHAIN_HEADER, chain.header()))
        # The batch's deadline is its last member's: the stage works on while anyone still waits for it.
        deadlines = [call.deadline for call in calls if call.deadline is not None]
        timeout = None
        if len(deadlines) == len(calls):
            timeout = max(deadlines) - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceeded(f"deadline exceeded before {what} was sent")
        try:
            response = await client.call("ModelInfer", request, timeout=timeout, metadata=metadata, what=what)
        except StageError as err:
            refused = _item_errors(err, calls) if len(calls) > 1 else {}
            if not refused or len(refused) == len(calls):
                if refused:  # every request carried a bad item: each hears of its own
                    return [refused[i] for i in range(len(calls))]
                raise
            # Answer the requests whose items were refused, and send the others again without them: one
            # more stage call, however many items were bad (the stage reports them all).
            if self.telemetry.enabled and (span := self.telemetry.current_span()) is not None:
                span.add_event(
                    "items refused; the rest sent again", {"pipeline.batch.items": sorted(refused)}
                )
            rest = [call for i, call in enumerate(calls) if i not in refused]
            answers = iter(await self._execute_batch(model, client, tensors, rest))
            return [refused[i] if i in refused else next(answers) for i in range(len(calls))]
        self.caching.observe_version(model, calls[0].version, response.model_version)
        return list(tensors.split(response_tensors(response), calls))

    async def close(self) -> None:
        """Stop every batcher (queued requests fail)."""
        await asyncio.gather(
            *(batcher.aclose() for batcher, _ in self.batchers.values()),
            *self._draining,
            return_exceptions=True,
        )


def _too_large(config: BatchingConfig, signature: ModelSignature) -> bool:
    """Whether batches of `config` would be larger than a model of `signature` takes."""
    return bool(signature.max_batch_size) and config.max_batch_size > signature.max_batch_size


#: A foreign stage's refusal names its item only in the message (`NAME[i]: ...`); ours send details.
_ITEM = re.compile(r"\b([A-Za-z_][\w.]*)\[(\d+)\]")


def _item_errors(err: StageError, calls: Sequence[BatchMember]) -> dict[int, StageError]:
    """Which requests of a batch a stage's INVALID_ARGUMENT refused, each with its own error (its items'
    indices made its own). The items come from the error's `BadRequest` details; from a stage that sends
    none, the first `NAME[i]` of the message."""
    if err.code != grpc.StatusCode.INVALID_ARGUMENT:
        return {}
    items = list(err.items)
    if not items:
        match = _ITEM.search(err.message)
        if match is None:
            return {}
        items = [ItemError(match.group(1), int(match.group(2)), err.message[match.end() :].lstrip(": "))]
    starts = list(itertools.accumulate((call.size for call in calls), initial=0))
    mine: dict[int, list[ItemError]] = {}
    for item in items:
        index = bisect.bisect_right(starts, item.index) - 1
        if not 0 <= index < len(calls) or item.index >= starts[-1]:
            return {}  # an index outside the batch: the error is not about items of this batch
        mine.setdefault(index, []).append(
            ItemError(item.tensor, item.index - starts[index], item.description)
        )
    return {
        index: StageError(InvalidInput.for_items(own).message, err.code, items=own)
        for index, own in mine.items()
    }
