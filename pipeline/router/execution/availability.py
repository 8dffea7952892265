"""Which ensembles the router can serve now, and why it cannot serve the others; and its readiness.

At start-up the router waits for its stages to be SERVING, then serves every ensemble whose models the
stages serve: each step's stage found and its model's signature learnt, against which the ensemble is
checked (how the stages are waited for and asked is `pipeline.router.execution.ensemble_stages`'s). An ensemble
whose models no stage serves is UNAVAILABLE with its reason (`unavailable`), and is
tried again every second while the router serves and before a request for it (`ModelInfer`, `ModelReady`)
is answered: a model loaded later makes it available. A model that its stage's `RepositoryIndex` listed as
READY and lists no more (unloaded) makes its ensembles UNAVAILABLE again, within a second or at the next
`ModelReady`, until it is served again. The files' own mistakes (a signature mismatch, a
model no stage can ever be found for) stop the router at start-up instead, as Triton's `--exit-on-error`
does; without it, and found later, they keep the ensemble UNAVAILABLE, as do the ensembles that failed to
load (`failed`). Ensemble files read again (`reload`) replace their plans; one that fails to load or to
check keeps its last good plan, as Triton keeps a model's last good version.

Readiness follows Triton's `--strict-readiness`: strict (the default), the router is ready while every
ensemble is available and every stage healthy; otherwise once it has started. `ModelReady` and
`RepositoryIndex` tell each ensemble's own state either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import Catalog, EnsemblePlan
from pipeline.protocol.errors import ConfigError, Unavailable
from pipeline.router.execution.ensemble_stages import EnsembleStages, NotServed
from pipeline.router.registry import ENSEMBLE_VERSION, ModelRegistry
from pipeline.router.stages.discovery import StageDiscovery

log = logging.getLogger(__name__)


#: An ensemble's reason until the router has asked its stages.
STARTING = "the router is starting: waiting for its stages"

#: What serves an ensemble once its models are known (the plane's batchers and cache checks); raises
#: `ConfigError` for an ensemble it refuses.
Serve = Callable[[EnsemblePlan], None]


class EnsembleAvailability:
    """The catalog's ensembles: which are available, why the others are not, and the router's readiness."""

    def __init__(
        self,
        catalog: Catalog,
        stages: StageDiscovery,
        registry: ModelRegistry,
        *,
        strict_readiness: bool = True,
    ) -> None:
        """`stages` finds the stage of each model; the signatures learnt go to `registry`.
        `strict_readiness`: ready only while every ensemble is available and every stage healthy (Triton's
        default), else once started."""
        self.catalog = catalog
        self.stages = stages
        self.clients = stages.clients
        self.registry = registry
        #: The stages as the ensembles' steps need them: waited for, found, asked for signatures.
        self.ensemble_stages = EnsembleStages(stages, registry)
        self.strict_readiness = strict_readiness
        #: Every ensemble, each step's stage filled in once the ensemble is available.
        self.plans: dict[str, EnsemblePlan] = dict(catalog.ensembles)
        #: The ensembles that cannot be served now, each with the reason.
        self.unavailable: dict[str, str] = dict.fromkeys(catalog.ensembles, STARTING)
        #: The ensembles without a plan, which failed to load, each with the reason.
        self.failed: dict[str, str] = dict(catalog.failed)
        #: The ensembles whose files were read again and failed: each keeps its last good plan, and why.
        self.reload_errors: dict[str, str] = {}
        #: The models the ensembles' steps call: their signatures and batching come with their ensembles.
        self.members = {step.model_name for plan in catalog.ensembles.values() for step in plan.steps}
        #: Whether the start-up's discovery is done.
        self.started = False
        #: Set once the start-up has looked at the stages: it is done, or waits for a stage.
        self._looked = asyncio.Event()
        #: One look at the stages for the unavailable ensembles at a time (`complete`), and how many began.
        self._looking = asyncio.Lock()
        self._looks = 0
        #: Set when a stage's health or an ensemble's availability changes: wakes `monitor`.
        self._changed = asyncio.Event()
        self._serve: Serve = lambda plan: None

    # --- start-up and availability --------------------------------------------------------------------

    async def discover(self, retry_interval: float, serve: Serve, *, exit_on_error: bool = True) -> None:
        """Wait for the stages (see `settle`), then serve every ensemble whose models they serve (`serve`
        sets up each). An ensemble the files get wrong (a signature mismatch, a model no stage can ever be
        found for) raises `ConfigError` with `exit_on_error`, else stays UNAVAILABLE with the reason; one
        whose models are not served is UNAVAILABLE and tried again while the router serves (`monitor`)."""
        self._serve = serve
        for client in self.clients.values():
            client.start()
        await self.settle(retry_interval)
        await self.complete(at_start=exit_on_error)
        self.started = True
        self._looked.set()
        for name, reason in sorted(self.failed.items()):
            log.error("ensemble '%s' is not available: %s", name, reason)
        for name, reason in sorted(self.unavailable.items()):
            log.warning("ensemble '%s' is not available: %s", name, reason)

    async def settle(self, retry_interval: float) -> None:
        """Wait for the stages (see `EnsembleStages.settle`); meanwhile each unavailable ensemble's reason
        says what it waits for, and requests for it are answered with that reason instead of held."""
        reported: float | None = None  # when the wait was last logged

        def waiting(states: Mapping[str, str]) -> None:
            nonlocal reported
            self._looked.set()
            stages = ", ".join(f"stage '{key}' {state}" for key, state in states.items())
            for name in self.unavailable:
                missing = self.ensemble_stages.not_listed([self.catalog.ensembles[name]])
                listed = f"; no stage lists model(s) {', '.join(missing)} as READY yet" if missing else ""
                self.unavailable[name] = f"{STARTING} ({stages}{listed})"
            now = time.monotonic()
            if reported is None or now - reported > 30:
                reported = now
                log.info("waiting for %s", stages)
                missing = self.ensemble_stages.not_listed(self.catalog.ensembles[n] for n in self.unavailable)
                if missing:
                    log.info(
                        "waiting for a stage that serves model(s) %s: no RepositoryIndex of %s lists them as "
                        "READY yet",
                        ", ".join(missing),
                        self.ensemble_stages.asked(),
                    )

        await self.ensemble_stages.settle(retry_interval, waiting)

    async def complete(self, *, at_start: bool = False) -> None:
        """Serve each ensemble that is not available yet and whose models the stages serve now: its steps'
        stages found, its models' signatures learnt and the ensemble checked against them. At start-up an
        ensemble the files get wrong raises `ConfigError` (every one named); later it stays UNAVAILABLE
        with the reason. Callers meanwhile share looks: a call returns once a look that began after it has
        ended, so many requests for an unavailable ensemble cost the stages two looks, not one each."""
        asked = self._looks
        async with self._looking:
            if self._looks > asked or not self.unavailable:
                return
            self._looks += 1
            await self._look(at_start)

    async def _look(self, at_start: bool) -> None:
        await self.stages.refresh_index()
        errors = []
        for name in sorted(self.unavailable):
            if name not in self.unavailable:  # made available, or gone, by a reload meanwhile
                continue
            try:
                plan = await self._checked(self.catalog.ensembles[name])
            except NotServed as err:
                self._not_available(name, str(err))
                continue
            except ConfigError as err:
                errors.append(str(err))
                self._not_available(name, str(err), error=True)
                continue
            self._available(plan)
        if at_start and errors:
            raise ConfigError("\n".join(errors))

    async def _checked(self, plan: EnsemblePlan) -> EnsemblePlan:
        """`plan` matched to the stages (see `EnsembleStages.matched`) and set up to serve; `NotServed` or
        `ConfigError` where it cannot be."""
        plan = await self.ensemble_stages.matched(plan)
        self._serve(plan)
        return plan

    async def reload(self, catalog: Catalog) -> None:
        """Serve the ensembles of `catalog`, the files read again: a new or changed plan replaces the one
        before once it checks (an available ensemble meanwhile serves its last good plan; one that does not
        check keeps it, with the reason in `reload_errors`), a file that fails keeps an available
        ensemble's last good plan (else the ensemble is failed with the reason), and an ensemble whose file
        is gone is no longer served. The stages are the router's
        own from its start: a plan that declares another stage or address fails."""
        before = dict(self.catalog.ensembles)
        plans = dict(catalog.ensembles)
        failed = dict(catalog.failed)
        for name, plan in list(plans.items()):
            if moved := self.ensemble_stages.moved(plan):
                failed[name] = moved
                del plans[name]
        for name in {*self.plans, *self.failed} - {*plans, *failed}:
            log.info("ensemble '%s': its file is gone, so it is no longer served", name)
            for known in (self.plans, self.unavailable, self.failed, self.reload_errors):
                known.pop(name, None)
        for name, reason in failed.items():
            if name in before and name not in self.unavailable:  # it keeps its last good plan
                plans[name] = before[name]
                self._reload_failed(name, reason)
                continue
            self.plans.pop(name, None)  # a plan that never served gives way to the file's failure
            self.unavailable.pop(name, None)
            if self.failed.get(name) != reason:
                log.error("ensemble '%s' is not available: %s", name, reason)
                self.failed[name] = reason
        self._set_plans(plans)
        for name, plan in sorted(plans.items()):
            if name in failed or before.get(name) == plan:
                if name not in failed:
                    self.reload_errors.pop(name, None)
                continue
            self.members.update(step.model_name for step in plan.steps)
            self.failed.pop(name, None)
            self.reload_errors.pop(name, None)
            if name not in self.plans or name in self.unavailable:
                self.plans[name] = plan
                self.unavailable[name] = f"{STARTING} (its file was read again)"
                continue
            try:
                checked = await self._checked(plan)
            except (NotServed, ConfigError) as err:
                plans[name] = before[name]
                self._reload_failed(name, str(err))
                continue
            self._available(checked)
            log.info("ensemble '%s': serving its new plan from %s", name, plan.source)
        self._set_plans(plans)
        self._changed.set()
        if self.unavailable:
            await self.complete()

    def _set_plans(self, plans: dict[str, EnsemblePlan]) -> None:
        self.catalog = replace(self.catalog, ensembles=types.MappingProxyType(dict(plans)))
        self.stages.catalog = self.catalog

    def _reload_failed(self, name: str, reason: str) -> None:
        if self.reload_errors.get(name) != reason:
            log.error(
                "ensemble '%s': its file, read again, fails; its last good plan serves: %s", name, reason
            )
        self.reload_errors[name] = reason

    def _not_available(self, name: str, reason: str, *, error: bool = False) -> None:
        if self.started and self.unavailable.get(name) != reason:
            (log.error if error else log.warning)("ensemble '%s' is not available: %s", name, reason)
        self.unavailable[name] = reason

    def _available(self, plan: EnsemblePlan) -> None:
        for step in plan.steps:
            self.stages.assign(step.model_name, step.stage)
        self.plans[plan.name] = plan
        self.unavailable.pop(plan.name, None)  # a plan read again replaces one that was available
        self._changed.set()
        if self.started:
            log.info("ensemble '%s' is available: the stages serve every model of its steps", plan.name)

    def withdraw_unserved(self) -> None:
        """Make UNAVAILABLE each available ensemble with a step whose model its stage's `RepositoryIndex`
        listed as READY and lists no more (it was unloaded, or a reload failed), as Triton's ensemble stops
        being ready with its models. It is looked at again as the other unavailable ones are: the model
        served again makes it available again."""
        for name, plan in self.plans.items():
            if name not in self.unavailable and (unserved := self.ensemble_stages.unserved(plan)):
                self._not_available(name, unserved)
                self._changed.set()

    def refit(self, model: str) -> None:
        """`model` was loaded again with another signature: each available ensemble that calls it is
        UNAVAILABLE until checked against it at the next look (`complete`), as Triton loads them again."""
        for name, plan in self.plans.items():
            if name not in self.unavailable and any(step.model_name == model for step in plan.steps):
                self._not_available(name, f"model '{model}' was loaded again; checking the ensemble")
                self._changed.set()

    async def available_plan(self, name: str, timeout: float | None) -> EnsemblePlan:
        """The plan of an ensemble that can be served now, each step's stage filled in; `Unavailable` with
        the reason where it cannot. While the router starts, a request waits for its first look at the
        stages (within `timeout`): an ensemble whose stages are up is served then, and one that waits for
        a stage gets the reason at once. Once started, an ensemble that is not available is looked at
        again first (within `timeout`), so that a model loaded on its stage a moment ago serves the next
        request."""
        with contextlib.suppress(TimeoutError):
            if not self._looked.is_set():
                await asyncio.wait_for(self._looked.wait(), timeout)
            if self.started and name in self.unavailable:
                await asyncio.wait_for(self.complete(), timeout)
        reason = self.unavailable.get(name)
        if reason is not None:
            raise Unavailable(f"ensemble '{name}' is not available: {reason}")
        return self.plans[name]

    async def ensemble_ready(self, name: str) -> bool:
        """Whether an ensemble can serve now (`ModelReady`): started, looked at again where it is not
        available (see `available_plan`), and every stage of its steps serving."""
        if not self.started:
            return False
        if name not in self.unavailable:
            # A model of it unloaded a moment ago makes it not ready now, not at the next monitor round.
            await self.stages.refresh_index()
            self.withdraw_unserved()
        if name in self.unavailable:
            await self.complete()
        return self.ensemble_problem(name) is None

    def ensemble_problem(self, name: str) -> str | None:
        """Why an ensemble cannot serve now (None: it can): it failed to load, it is not available, or the
        stages of its steps do not serve it now (see `EnsembleStages.problem`)."""
        reason = self.failed.get(name) or self.unavailable.get(name)
        if reason is not None:
            return reason
        return self.ensemble_stages.problem(self.plans[name])

    # --- health --------------------------------------------------------------------------------------

    async def monitor(
        self, interval: float = 1.0, on_ready: Callable[[bool], Awaitable[None]] | None = None
    ) -> None:
        """Keep each stage's health current, so readiness reflects stages that stop or return; `on_ready`
        hears of every change of `ready()` (the router's health service reports it)."""
        was_ready: bool | None = None
        changed = self._changed
        for client in self.clients.values():
            client.replicas.listeners.append(changed.set)
        while True:
            changed.clear()
            await asyncio.gather(*(c.replicas.check_health(timeout=interval) for c in self.clients.values()))
            # A model unloaded since makes its ensembles unavailable, and one loaded since makes them
            # available (the index is asked again there); a version a stage stopped serving takes its
            # cached responses with it.
            await self.stages.refresh_index()
            self.withdraw_unserved()
            if self.unavailable:
                await self.complete()
            ready = self.ready()
            if ready != was_ready and on_ready is not None:
                await on_ready(ready)
            if ready != was_ready and was_ready is not None:
                log.info("router %s", "ready" if ready else f"not ready: {self._not_ready_reason()}")
            was_ready = ready
            # The replicas' health watches wake this at once when a stage's readiness changes, and so
            # does an ensemble that a request found available.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), interval)

    def ready(self) -> bool:
        """Whether the router is ready: started and, with strict readiness, every ensemble available and
        every stage healthy."""
        if not self.started:
            return False
        return not self.strict_readiness or not self._not_ready_reason()

    def _not_ready_reason(self) -> str:
        """What strict readiness waits for ("" when nothing)."""
        if self.unavailable or self.failed:
            return f"ensemble(s) {', '.join(sorted({*self.unavailable, *self.failed}))} not available"
        down = self.ensemble_stages.down()
        return f"stage(s) {', '.join(down)} down" if down else ""


async def repository_index(ensembles: EnsembleAvailability, ready_only: bool) -> pb.RepositoryIndexResponse:
    """The router's `RepositoryIndex`: the ensembles (UNAVAILABLE with the reason where they cannot serve now),
    then every stage's models (see `StageDiscovery.stage_models_index`)."""
    reply = pb.RepositoryIndexResponse()
    for name in sorted({*ensembles.plans, *ensembles.failed}):
        reason = ensembles.ensemble_problem(name)
        if reason is None:
            # A file read again that failed: its last good plan serves, and the index says why.
            reload_error = ensembles.reload_errors.get(name, "")
            reply.models.add(name=name, version=ENSEMBLE_VERSION, state="READY", reason=reload_error)
        elif not ready_only:
            reply.models.add(name=name, version=ENSEMBLE_VERSION, state="UNAVAILABLE", reason=reason)
    reply.models.extend(await ensembles.stages.stage_models_index(ready_only, ensembles.plans))
    return reply
