"""The stages as the ensembles need them: waited for at start-up, each step's stage and model signature found,
and whether they still serve the models of an ensemble's steps.

At start-up the router waits for its stages to be SERVING (one that is up and still loading, as long as it
loads; one that cannot be reached, `SETTLE_S`). A step that names no stage gets the first declared stage
whose `RepositoryIndex` lists its model as READY, and every step's model its signature, learnt from its
stage, against which the ensemble is checked. A model its stage's `RepositoryIndex` listed as READY and lists
no more was unloaded. Which ensembles are available, from all this, is `pipeline.router.execution.availability`'s.
"""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from pipeline.ensemble.plan import EnsemblePlan
from pipeline.ensemble.signatures import check_signatures
from pipeline.protocol.errors import ConfigError, PipelineError
from pipeline.router.registry import ModelRegistry
from pipeline.router.stages.discovery import StageDiscovery
from pipeline.router.stages.replicas import NOT_SERVING
from pipeline.router.stages.stage_client import StageClient

#: How long the router waits at start-up for a stage it cannot reach before it serves what the others serve.
SETTLE_S = 30.0


class NotServed(Exception):
    """An ensemble's models are not all served now (its message says which, and where the router looked)."""


class EnsembleStages:
    """The stages (`stages` finds the stage of each model) as the ensembles' steps need them; the signatures
    learnt go to `registry`."""

    def __init__(self, stages: StageDiscovery, registry: ModelRegistry) -> None:
        self.stages = stages
        self.clients = stages.clients
        self.registry = registry
        #: (stage, model) of the steps of checked plans that the stage's `RepositoryIndex` has listed as
        #: READY: one no longer listed was unloaded (`unserved`).
        self._listed: set[tuple[str, str]] = set()

    async def settle(self, retry_interval: float, waiting: Callable[[Mapping[str, str]], None]) -> None:
        """Wait until every stage is SERVING, waiting for one that is up and still loading (its models are
        on their way) as long as it loads, and for one that cannot be reached up to `SETTLE_S`. `waiting`
        hears, each time it waits, the stages it waits for, each with why."""
        started = time.monotonic()
        while True:
            await asyncio.gather(*(c.replicas.check_health(timeout=2.0) for c in self.clients.values()))
            await self.stages.refresh_index()
            now = time.monotonic()
            states = {
                key: "still loading" if loading else "not reachable"
                for key, client in self.clients.items()
                if not client.replicas.healthy and ((loading := _loading(client)) or now - started < SETTLE_S)
            }
            if not states:
                return
            waiting(states)
            await asyncio.sleep(retry_interval)

    def asked(self) -> str:
        """The stages whose `RepositoryIndex` the router asks, for messages."""
        return ", ".join(f"'{key}' ({c.endpoint.address})" for key, c in self.clients.items())

    def down(self) -> list[str]:
        """The stages with no replica serving."""
        return [key for key, client in self.clients.items() if not client.replicas.healthy]

    def not_listed(self, plans: Iterable[EnsemblePlan]) -> list[str]:
        """The models of the steps of `plans` that name no stage and that no stage's `RepositoryIndex` lists
        as READY yet."""
        return sorted(
            {
                step.model_name
                for plan in plans
                for step in plan.steps
                if not step.stage
                and step.model_name not in self.stages.stage_of_model
                and step.model_name not in self.stages.repository_models
            }
        )

    def moved(self, plan: EnsemblePlan) -> str:
        """Why a plan read again cannot be served by the router's stages ("" where it can)."""
        moved = [
            f"'{key}' ({endpoint.address})"
            for key, endpoint in plan.stages.items()
            if key not in self.clients or self.clients[key].endpoint != endpoint
        ]
        if not moved:
            return ""
        return (
            f"{plan.source}: stage(s) {', '.join(moved)} differ from the router's stages, which are set when "
            "it starts: restart it to change them"
        )

    async def matched(self, plan: EnsemblePlan) -> EnsemblePlan:
        """`plan` with its steps' stages found, its models' signatures learnt and the plan checked against
        them; `NotServed` or `ConfigError` where it cannot be served."""
        plan = self._resolved(plan)
        if unserved := self.unserved(plan):
            raise NotServed(unserved)
        await self._learn_signatures(plan)
        check_signatures(plan, self.registry.signatures)
        return plan

    def unserved(self, plan: EnsemblePlan) -> str:
        """Why a plan's models are no longer served ("" while they are): the steps' models that their stage
        listed as READY and no longer lists. Each model a stage lists is noted as listed."""
        gone = []
        for step in plan.steps:
            index = self.stages.indexes.get(step.stage)
            if index is None:  # a stage without RepositoryIndex, or not asked yet: it cannot say
                continue
            key = (step.stage, step.model_name)
            if step.model_name in index:
                self._listed.add(key)
            elif key in self._listed:
                gone.append(f"'{step.model_name}' on stage '{step.stage}'")
        if not gone:
            return ""
        models = ", ".join(sorted(set(gone)))
        return f"model(s) {models} no longer served: not READY in the stage's RepositoryIndex"

    def _resolved(self, plan: EnsemblePlan) -> EnsemblePlan:
        """`plan` with the stage of each step that names none: the first declared stage whose
        `RepositoryIndex` lists its model as READY. `NotServed` where none does yet; `ConfigError` where
        none ever can (no stage, or none with a `RepositoryIndex`)."""
        missing = sorted(
            {
                step.model_name
                for step in plan.steps
                if not step.stage and self.stages.find_stage(step.model_name) is None
            }
        )
        if missing:
            self._check_findable(plan, missing)
            raise NotServed(
                f"no stage serves model(s) {', '.join(missing)}: the RepositoryIndex of {self.asked()} does "
                "not list them as READY"
            )
        if all(step.stage for step in plan.steps):
            return plan
        steps = tuple(
            step if step.stage else replace(step, stage=self.stages.stage_of_model[step.model_name])
            for step in plan.steps
        )
        declared = self.stages.catalog.stages
        stages = {**plan.stages, **{step.stage: declared[step.stage] for step in steps}}
        return replace(plan, steps=steps, stages=types.MappingProxyType(stages))

    def _check_findable(self, plan: EnsemblePlan, models: list[str]) -> None:
        """Raise `ConfigError` where no stage can ever say that it serves `models`."""
        if not self.clients:
            raise ConfigError(
                f"{plan.source}: no stage to serve model(s) {', '.join(models)}: a step names no stage and the "
                "router has none (give them with --stage NAME=ADDRESS)"
            )
        if len(self.stages.indexes) == len(self.clients) and all(
            m is None for m in self.stages.indexes.values()
        ):
            raise ConfigError(
                f"{plan.source}: no stage can say whether it serves model(s) {', '.join(models)}: none of "
                f"{', '.join(self.clients)} implements RepositoryIndex; name the stage in the step"
            )

    async def _learn_signatures(self, plan: EnsemblePlan) -> None:
        """Ask each step's stage for its model's signature (once per model); `NotServed` naming each model
        that its stage does not serve now, and why."""
        signatures = self.registry.signatures
        problems = []
        for step in sorted(plan.steps, key=lambda s: s.index):
            model = step.model_name
            if model in signatures:
                continue
            try:
                self.registry.learn(model, await self.clients[step.stage].signature(model))
            except PipelineError as err:
                problems.append(f"{step.label}: {err.message}")
        if problems:
            raise NotServed("; ".join(problems))

    def problem(self, plan: EnsemblePlan) -> str | None:
        """Why the stages of a plan's steps cannot serve it now (None: they can): a stage has no replica
        serving, or none that serves the step's model (replicas of a stage may serve different models)."""
        steps = plan.steps
        down = sorted({step.stage for step in steps if not self.clients[step.stage].replicas.healthy})
        if down:
            return f"no replica of stage(s) {', '.join(down)} is serving"
        unserved = sorted(
            {
                f"'{step.model_name}' on stage '{step.stage}'"
                for step in steps
                if not self.clients[step.stage].replicas.serving(step.model_name)
            }
        )
        if unserved:
            return f"no replica that serves model(s) {', '.join(unserved)} is serving"
        return None


def _loading(client: StageClient) -> bool:
    """Whether a stage is up but not serving yet: a replica answers its health NOT_SERVING (loading)."""
    return any(replica.state == NOT_SERVING for replica in client.replicas.by_address.values())
