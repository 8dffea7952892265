"""The router's response-cache policy: which requests are cached, under which versions, and when entries go.

`pipeline.router.caching.response_cache` holds the entries; this decides for it. A stage model's requests are cached where
its config enables `response_cache` and does not declare it non-deterministic; an ensemble's where its file
enables it (every step's model must then be deterministic, checked at start-up). A request's key names the
versions that would answer it: for a request naming none, the version its stage last answered with
(`observe_version`). A stage that answers with another version, or stops listing one as READY, takes that
version's entries with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import EnsemblePlan, ModelSignature
from pipeline.protocol.errors import ConfigError, StageError
from pipeline.router.caching.response_cache import ResponseCache, Version, request_key
from pipeline.router.registry import ModelRegistry, batch_items
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.telemetry import CACHE_HIT, Telemetry

log = logging.getLogger(__name__)


class ResponseCaching:
    """The response cache (None when `--cache-size` is 0) and the policy that keys and drops its entries."""

    def __init__(
        self, registry: ModelRegistry, cache_size: int, *, telemetry: Telemetry, metrics: Metrics
    ) -> None:
        """`cache_size`: bytes of the response cache, for the models and ensembles that enable it (0: off)."""
        self.registry = registry
        self.telemetry = telemetry
        self.metrics = metrics
        self.cache = ResponseCache(cache_size, metrics) if cache_size > 0 else None
        #: Stage model -> the version that answers a request naming none, as the stage last said.
        self.default_versions: dict[str, str] = {}
        if self.cache is not None:
            self._export_gauges(self.cache, metrics)

    @staticmethod
    def _export_gauges(cache: ResponseCache, metrics: Metrics) -> None:
        metrics.gauge(
            "pipeline_cache_bytes",
            "Bytes the response cache holds now",
            "cache",
            lambda: [("responses", cache.bytes)],
        )
        metrics.gauge(
            "pipeline_cache_waiting",
            "Requests waiting now for an identical request's response",
            "cache",
            lambda: [("responses", cache.waiting)],
        )
        metrics.gauge(
            "pipeline_cache_entries",
            "Responses the cache holds now",
            "cache",
            lambda: [("responses", len(cache))],
        )

    @property
    def holds_entries(self) -> bool:
        """Whether the cache holds any response now."""
        return self.cache is not None and len(self.cache) > 0

    # --- which models are cached ---------------------------------------------------------------------

    def check(self, ensembles: Iterable[EnsemblePlan], stage_of_model: Mapping[str, str]) -> None:
        """At start-up, once the stage models' signatures are known: note the version that answers each,
        refuse a response cache asked for a model that says its answers may differ for one request (an
        ensemble's cache covers every step's model), and say when the cache is asked for but off."""
        signatures = self.registry.signatures
        for model, signature in signatures.items():
            self._note_default(model, signature)
        ensembles = list(ensembles)
        errors = []
        for plan in ensembles:
            if not plan.response_cache:
                continue
            for step in sorted(plan.steps, key=lambda s: s.index):
                if not signatures[step.model_name].deterministic:
                    errors.append(
                        f"{plan.source}: response_cache is enabled, but {step.label} calls model "
                        f"'{step.model_name}', which declares itself non-deterministic (parameter "
                        'deterministic: "false"): a cached response would replay one of its answers for '
                        "requests that should get fresh ones; disable the ensemble's response_cache"
                    )
        for model, stage in stage_of_model.items():
            signature = signatures[model]
            if signature.response_cache and not signature.deterministic:
                errors.append(
                    f"model '{model}' on stage '{stage}': its config enables "
                    "response_cache but declares the model non-deterministic (parameter deterministic: "
                    '"false"); a cached response would replay one answer for requests that should get fresh ones'
                )
        if errors:
            raise ConfigError("\n".join(errors))
        asking = [p.name for p in ensembles if p.response_cache] + [
            m for m in stage_of_model if signatures[m].response_cache
        ]
        if asking and self.cache is None:
            log.warning(
                "response_cache is enabled for %s, but the router's cache is off (--cache-size 0)",
                ", ".join(asking),
            )

    def learn(self, name: str, signature: ModelSignature) -> None:
        """A repository model that no ensemble names, called for the first time: note the version that
        answers it; a cache its config asks for but that would replay non-deterministic answers is not used."""
        self._note_default(name, signature)
        if signature.response_cache and not signature.deterministic:
            log.error(
                "model '%s': its config enables response_cache but declares the model non-deterministic; "
                "its responses are not cached",
                name,
            )

    def _note_default(self, name: str, signature: ModelSignature) -> None:
        self.default_versions.setdefault(name, signature.versions[-1] if signature.versions else "")

    def versions(self, plan: EnsemblePlan | None, name: str, version: str) -> tuple[Version, ...] | None:
        """The versions that would answer a request, for its cache key; None when it is not to be cached."""
        if self.cache is None:
            return None
        if plan is not None:
            if not plan.response_cache:
                return None
            steps = sorted(plan.steps, key=lambda s: s.index)
            return tuple(
                dict.fromkeys(
                    (s.model_name, s.model_version or self.default_versions.get(s.model_name, ""))
                    for s in steps
                )
            )
        signature = self.registry.signatures.get(name)
        if signature is None or not signature.response_cache or not signature.deterministic:
            return None
        return ((name, version or self.default_versions.get(name, "")),)

    # --- when entries go -----------------------------------------------------------------------------

    def observe_version(self, model: str, asked: str, answered: str) -> None:
        """A stage answered `model`: when a request naming no version got another version than before, the
        old one's cached responses go (the stage serves a new default, or was reloaded)."""
        if asked or not answered:
            return
        known = self.default_versions.get(model)
        if known == answered:
            return
        self.default_versions[model] = answered
        if known is not None and self.cache is not None:
            dropped = self.cache.drop(model, known)
            log.info(
                "model '%s' now answers as version %s (was %s): %d cached responses dropped",
                model,
                answered,
                known or "unknown",
                dropped,
            )

    def drop_unserved(self, ready_versions: Callable[[str], frozenset[str] | None]) -> None:
        """Drop the cached responses of every version that its stage's `RepositoryIndex` no longer lists as
        READY. `ready_versions` says which versions of a model its stage lists as READY, None where it
        cannot say (a stage without the RPC: NOT_FOUND and version changes cover it)."""
        if self.cache is None:
            return
        for model, version in self.cache.versions():
            if not version:
                continue
            ready = ready_versions(model)
            if ready is not None and version not in ready:
                dropped = self.cache.drop(model, version)
                log.info(
                    "model '%s' version %s is no longer served: %d cached responses dropped",
                    model,
                    version,
                    dropped,
                )

    # --- answering -----------------------------------------------------------------------------------

    async def fetch(
        self,
        plan: EnsemblePlan | None,
        request: pb.ModelInferRequest,
        call: RequestContext,
        versions: tuple[Version, ...],
        execute: Callable[[], Awaitable[pb.ModelInferResponse]],
    ) -> pb.ModelInferResponse:
        """Answer from the response cache, or run the request (`execute`) and keep its response there."""
        assert self.cache is not None
        name = request.model_name
        started = time.perf_counter_ns()
        key = request_key(name, versions, request)
        stats = self.registry.stats_of(name)
        computed = False

        async def compute() -> tuple[bytes, tuple[Version, ...]]:
            nonlocal computed
            computed = True
            response = await execute()
            # A stage model's entry belongs to the version that answered.
            answered = versions if plan is not None else ((name, response.model_version or versions[0][1]),)
            return response.SerializeToString(), answered

        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        try:
            raw, hit, cache_ns = await self.cache.fetch(key, compute, deadline=deadline)
        except BaseException as err:
            if not computed:  # the request it waited for failed and this one ran out of time
                stats.request_failed(time.perf_counter_ns() - started)
            if isinstance(err, StageError) and err.code == grpc.StatusCode.NOT_FOUND:
                for model, version in versions:
                    self.cache.drop(model, version)
            raise
        span = self.telemetry.current_span() if self.telemetry.enabled else None
        if span is not None:
            span.set_attribute(CACHE_HIT, hit)
        self.metrics.cache_requests.labels(name, "hit" if hit else "miss").inc()
        if not hit:
            stats.cache_missed(cache_ns)
            return pb.ModelInferResponse.FromString(raw)
        response = pb.ModelInferResponse.FromString(raw)
        response.id = request.id
        if plan is not None:
            first = request.inputs[0].shape if request.inputs else ()
            items = int(first[0]) if plan.max_batch_size > 0 and first else 1
        else:
            outputs = response.outputs
            items = batch_items(self.registry.signatures.get(name), outputs[0].shape if outputs else ())
        stats.cache_hit_done(items=items, total_ns=time.perf_counter_ns() - started, cache_ns=cache_ns)
        return response
