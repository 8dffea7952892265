"""Model management across the fleet: Triton's repository API at the router, acting on every replica.

`RepositoryModelLoad` at the router loads the model on every replica of the stage that serves it (or whose
repository holds it), all at once, with the caller's parameters (Triton's `config`, `file:` overrides) and
credentials. It succeeds only if every replica loaded it; otherwise the replicas that did are loaded back to
what they served before (the versions they listed READY, with the config they served them with), so the
fleet never stays split, and the error names the replica that failed and why.

While a load is under way, requests that name no version keep going to the replicas that serve the version
the fleet served before (its *fleet version*): a replica that has switched is taken out of their rotation as
soon as its load returns, and once every replica has loaded, the fleet version becomes the new one. A client
therefore sees the old version until every replica has the new one, then the new; only a request that a
replica took between its own switch and the end of its load call can see the new version early (this
window is what `bench/rollout.py` measures). A request that names a version goes to the replicas that list
it, as always.

A model loaded with another interface (its config's inputs, outputs or batching) is served as it says from
the load's answer on: the router learns its signature again, its batcher follows it, and the ensembles that
use it are checked against it again (UNAVAILABLE, saying why, while they do not fit it).

`RepositoryModelUnload` unloads the model from every replica of its stage, with the same all-or-nothing
rule. The ensembles that use a model follow it: UNAVAILABLE while it is unloaded, available again once it is
loaded (`EnsembleAvailability`), whatever `unload_dependents` says (it is checked, and passed to no stage).

What the fleet serves after a load or an unload through the router is remembered: a replica that starts
later (a restart, a scale-up) and serves something else, because its disk says so, is loaded (or unloaded)
to match within a second of being seen, and until then takes no request for the model that names no
version. Both RPCs need model control enabled at the router as at the stages
(`pipeline.runtime.model_control`, closed by default), and the stages must allow them to the caller's
credentials, which the router passes on (its own token only for the loads that bring a later replica in
line).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import json_format

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import (
    InvalidInput,
    PipelineError,
    RepositoryNotFound,
    StageError,
    Unavailable,
    echo,
)
from pipeline.router.execution.availability import EnsembleAvailability
from pipeline.router.stages.discovery import StageDiscovery, ready_of
from pipeline.router.stages.replicas import DOWN, SERVING, Replica
from pipeline.router.stages.stage_client import StageClient
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.model_control import check_control_enabled
from pipeline.runtime.repository import check_model_name

log = logging.getLogger(__name__)

#: The prefix of Triton's file-override parameters: `file:<version>/<file name>` with the file's bytes.
FILE_PARAMETER = "file:"
#: Seconds between looks for replicas that do not serve what the fleet serves.
RECONCILE_INTERVAL_S = 1.0
#: The longest wait before a replica that failed to come in line is tried again.
MAX_RECONCILE_DELAY_S = 30.0

Parameters = dict[str, pb.ModelRepositoryParameter]


@dataclass(frozen=True)
class Before:
    """What one replica served of a model before a change: its READY versions and its config (None where it
    served none)."""

    versions: frozenset[str]
    config: mc.ModelConfig | None


@dataclass(frozen=True)
class Wanted:
    """What the fleet serves of a model since its last load or unload through the router."""

    loaded: bool
    #: The load's parameters, sent again to a replica that comes in later.
    parameters: Mapping[str, pb.ModelRepositoryParameter]
    #: The versions every replica listed READY after the load.
    versions: frozenset[str]


class FleetControl:
    """Loads and unloads across every replica of a stage, the fleet version of each model, and the replicas
    brought in line with what the fleet serves (see the module docstring)."""

    def __init__(
        self,
        stages: StageDiscovery,
        ensembles: EnsembleAvailability,
        *,
        explicit: bool = False,
        admin_configured: bool = False,
        metrics: Metrics | None = None,
        relearn: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        """`relearn` hears of each model loaded through the router, before the ensembles follow it."""
        self.stages = stages
        self.relearn = relearn
        self.ensembles = ensembles
        self.explicit, self.admin_configured = explicit, admin_configured
        self.metrics = metrics
        #: Model -> the version its requests that name none go to (shared with every stage client, which
        #: routes by it).
        self.fleet_versions: dict[str, str] = {}
        for client in stages.clients.values():
            client.fleet_versions = self.fleet_versions
            client.replicas.listeners.append(functools.partial(_forget_unserving, client))
        #: Model -> what the fleet serves of it, for the models loaded or unloaded through the router.
        self.wanted: dict[str, Wanted] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: (replica address, model) -> when a replica that failed to come in line is tried again, and how
        #: many times it failed.
        self._retry_at: dict[tuple[str, str], tuple[float, int]] = {}

    def _lock(self, model: str) -> asyncio.Lock:
        return self._locks.setdefault(model, asyncio.Lock())

    # --- RepositoryModelLoad -------------------------------------------------------------------------

    async def load(self, name: str, parameters: Mapping[str, object], call: RequestContext) -> None:
        """Load (or reload) `name` on every replica of its stage, or on none (see the module docstring)."""
        check_control_enabled(
            "RepositoryModelLoad", explicit=self.explicit, admin_configured=self.admin_configured
        )
        sent = load_parameters(parameters)
        self._refuse_ensemble(name, "RepositoryModelLoad")
        key, client = await self._stage_of(name, "load")
        auth = _auth(call, client)
        async with self._lock(name):
            replicas = _up(client)
            if not replicas:
                raise Unavailable(
                    f"stage '{key}' ({client.endpoint.address}) has no replica up to load model '{name}'"
                )
            before = await asyncio.gather(*(_served(client, r, name, auth) for r in replicas))
            old = set.intersection(*(set(b.versions) for b in before))
            if old:  # requests naming no version stay on the old version until every replica has the new
                self.fleet_versions[name] = _latest(old)
            started = time.monotonic()
            results = await asyncio.gather(
                *(_load_on(client, r, name, sent, auth, call.timeout) for r in replicas),
                return_exceptions=True,
            )
            failed = [(r, e) for r, e in zip(replicas, results, strict=True) if isinstance(e, BaseException)]
            if failed:
                done = [(r, b) for r, b, e in zip(replicas, before, results, strict=True) if e is None]
                rolled = await self._roll_back(client, name, done, auth)
                if name not in self.wanted and done and (first := done[0][1]).config is not None:
                    # The fleet serves what it served before, whatever the disk says now: a replica that
                    # comes later is loaded so too.
                    self.wanted[name] = Wanted(True, _pinned(first), first.versions)
                self._count(name, "load", "rolled_back")
                await self._settle()
                raise _failure("RepositoryModelLoad", name, key, failed, rolled)
            listed = [r.index.get(name, frozenset()) for r in replicas if r.index is not None]
            versions = frozenset.intersection(*listed) if listed else frozenset()
            if versions:
                self.fleet_versions[name] = _latest(versions)
            self.wanted[name] = Wanted(True, sent, versions)
            if self.relearn is not None:
                await self.relearn(name)
            self._count(name, "load", "ok")
            log.info(
                "model '%s': loaded on %d replica(s) of stage '%s' in %.2f s, serving version(s) %s",
                name,
                len(replicas),
                key,
                time.monotonic() - started,
                ", ".join(sorted(versions)) or "none",
            )
            await self._settle()

    async def _roll_back(
        self, client: StageClient, name: str, done: Sequence[tuple[Replica, Before]], auth: Metadata
    ) -> list[str]:
        """Put each replica of `done` back to what it served before; the replicas put back (each with what it
        serves again) and those that could not be, as text for the error."""
        said = []
        for replica, before in done:
            try:
                await _restore(client, replica, name, before, auth)
            except PipelineError as err:
                log.error(
                    "model '%s': replica %s could not be rolled back: %s", name, replica.address, err.message
                )
                said.append(f"{replica.address} could not be rolled back ({err.message})")
                continue
            served = ", ".join(sorted(before.versions)) or "nothing"
            said.append(f"{replica.address} rolled back (serving {served} again)")
        return said

    # --- RepositoryModelUnload -----------------------------------------------------------------------

    async def unload(self, name: str, parameters: Mapping[str, object], call: RequestContext) -> None:
        """Unload `name` from every replica of its stage, or from none (see the module docstring)."""
        check_control_enabled(
            "RepositoryModelUnload", explicit=self.explicit, admin_configured=self.admin_configured
        )
        unload_parameters(parameters)
        self._refuse_ensemble(name, "RepositoryModelUnload")
        key, client = await self._stage_of(name, "unload")
        auth = _auth(call, client)
        async with self._lock(name):
            replicas = _up(client)
            if not replicas:
                raise Unavailable(
                    f"stage '{key}' ({client.endpoint.address}) has no replica up to unload model '{name}'"
                )
            before = await asyncio.gather(*(_served(client, r, name, auth) for r in replicas))
            results = await asyncio.gather(
                *(_unload_on(client, r, name, auth, call.timeout) for r in replicas), return_exceptions=True
            )
            unknown = [
                e for e in results if isinstance(e, StageError) and e.code == grpc.StatusCode.NOT_FOUND
            ]
            failed = [
                (r, e)
                for r, e in zip(replicas, results, strict=True)
                if isinstance(e, BaseException) and e not in unknown
            ]
            if failed or (unknown and len(unknown) == len(replicas)):
                done = [
                    (r, b)
                    for r, b, e in zip(replicas, before, results, strict=True)
                    if e is None and b.versions
                ]
                rolled = await self._roll_back(client, name, done, auth)
                self._count(name, "unload", "rolled_back" if failed else "not_found")
                await self._settle()
                raise _failure(
                    "RepositoryModelUnload",
                    name,
                    key,
                    failed or list(zip(replicas, results, strict=True)),
                    rolled,
                )
            self.wanted[name] = Wanted(False, {}, frozenset())
            self.fleet_versions.pop(name, None)
            self._count(name, "unload", "ok")
            log.info("model '%s': unloaded from %d replica(s) of stage '%s'", name, len(replicas), key)
            await self._settle()

    # --- replicas that come later --------------------------------------------------------------------

    async def run(self, interval: float = RECONCILE_INTERVAL_S) -> None:
        """Bring the replicas in line with what the fleet serves, every `interval` seconds."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reconcile()
            except Exception:  # a look that fails must not end the router's monitoring: the next one tries
                log.exception("bringing the replicas in line with the fleet failed; trying again")

    async def reconcile(self) -> None:
        """Load (or unload) each model that the fleet serves through the router on each SERVING replica whose
        `RepositoryIndex` says otherwise: a replica that started later, or came back from a restart, with what
        its disk says. A replica that fails is tried again later, waiting longer each time."""
        now = time.monotonic()
        for name, wanted in list(self.wanted.items()):
            lock = self._lock(name)
            key = self.stages.stage_of_model.get(name) or self.stages.repository_models.get(name)
            if lock.locked() or key is None:
                continue
            client = self.stages.clients[key]
            for replica in list(client.replicas.by_address.values()):
                if replica.state != SERVING or replica.index is None:
                    continue
                serves = replica.index.get(name, frozenset())
                if (serves == wanted.versions) if wanted.loaded else not serves:
                    self._retry_at.pop((replica.address, name), None)
                    continue
                at, failures = self._retry_at.get((replica.address, name), (0.0, 0))
                if at > now:
                    continue
                async with lock:
                    try:
                        await self._bring_in_line(client, replica, name, wanted)
                    except PipelineError as err:
                        delay = min(MAX_RECONCILE_DELAY_S, 2.0**failures)
                        self._retry_at[(replica.address, name)] = (time.monotonic() + delay, failures + 1)
                        log.error(
                            "model '%s': replica %s of stage '%s' serves %s, not what the fleet serves, and "
                            "could not be brought in line (again in %.0f s): %s",
                            name,
                            replica.address,
                            key,
                            ", ".join(sorted(serves)) or "nothing",
                            delay,
                            err.message,
                        )
                        self._count(name, "reconcile", "failed")
                        continue
                self._retry_at.pop((replica.address, name), None)
                self._count(name, "reconcile", "ok")
                await self._settle()

    async def _bring_in_line(self, client: StageClient, replica: Replica, name: str, wanted: Wanted) -> None:
        auth = client.auth
        if wanted.loaded:
            log.info(
                "model '%s': replica %s serves %s; loading what the fleet serves (version(s) %s)",
                name,
                replica.address,
                ", ".join(sorted(replica.index.get(name, ()) if replica.index else ())) or "nothing",
                ", ".join(sorted(wanted.versions)),
            )
            await _load_on(client, replica, name, dict(wanted.parameters), auth, None)
        else:
            log.info("model '%s': replica %s serves it; unloading it as the fleet did", name, replica.address)
            await _unload_on(client, replica, name, auth, None)

    # --- helpers -------------------------------------------------------------------------------------

    def _refuse_ensemble(self, name: str, rpc: str) -> None:
        if name in self.ensembles.plans or name in self.ensembles.failed:
            raise InvalidInput(
                f"{rpc}: '{echo(name)}' is an ensemble, served by the router from its file; load or unload the "
                "models its steps call (the ensemble follows them), or change its file (--repository-poll-secs)"
            )

    async def _stage_of(self, name: str, action: str) -> tuple[str, StageClient]:
        """The stage that serves `name`, else the first declared whose replicas' repositories hold it
        (`action`, load or unload, names what failed where none does)."""
        check_model_name(name)
        stages = self.stages
        key = stages.stage_of_model.get(name) or stages.repository_models.get(name)
        if key is None:
            for candidate, client in stages.clients.items():
                await client.replicas.settle()
                answers = await asyncio.gather(
                    *(client.replica_index(r, ready_only=False) for r in _up(client)), return_exceptions=True
                )
                if any(isinstance(a, list) and any(m.name == name for m in a) for a in answers):
                    key = candidate
                    break
        if key is None:
            raise RepositoryNotFound(
                f"failed to {action} '{echo(name)}': no stage's model repository has it (stages: "
                f"{', '.join(stages.clients)})"
            )
        return key, stages.clients[key]

    async def _settle(self) -> None:
        """Let the router follow at once: the stages' indexes read again, the ensembles that use a model
        unloaded made UNAVAILABLE, and those whose models are all served now available."""
        await self.stages.refresh_index()
        self.ensembles.withdraw_unserved()
        if self.ensembles.unavailable:
            await self.ensembles.complete()

    def _count(self, model: str, action: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.repository_changes.labels(model, action, outcome).inc()


Metadata = tuple[tuple[str, str | bytes], ...]


def load_parameters(parameters: Mapping[str, object]) -> Parameters:
    """`RepositoryModelLoad`'s parameters checked and made protobuf again for the stages: `config` (a
    `ModelConfig` in JSON) and `file:<version>/<name>` (the file's bytes; base64 text over HTTP, as Triton
    takes it), which needs `config`, as in Triton. Anything else is refused, naming it."""
    sent: Parameters = {}
    for key, value in parameters.items():
        if key == "config":
            if not isinstance(value, str):
                raise InvalidInput(
                    "RepositoryModelLoad: parameter 'config' must be a string (a ModelConfig in JSON)"
                )
            try:
                json_format.Parse(value, mc.ModelConfig())
            except json_format.ParseError as exc:
                raise InvalidInput(
                    f"RepositoryModelLoad: parameter 'config' is not a ModelConfig in JSON: {exc}"
                ) from None
            sent[key] = pb.ModelRepositoryParameter(string_param=value)
        elif key.startswith(FILE_PARAMETER):
            sent[key] = pb.ModelRepositoryParameter(bytes_param=_file_content(key, value))
        else:
            raise InvalidInput(
                f"RepositoryModelLoad: parameter '{echo(key)}' is not supported (only 'config' and 'file:...')"
            )
    if any(key.startswith(FILE_PARAMETER) for key in sent) and "config" not in sent:
        raise InvalidInput(
            "RepositoryModelLoad: file overrides need the parameter 'config' too, as in Triton"
        )
    return sent


def _file_content(key: str, value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(f"RepositoryModelLoad: parameter '{echo(key)}' is not base64 text") from None
    raise InvalidInput(f"RepositoryModelLoad: parameter '{echo(key)}' must be the file's bytes")


def unload_parameters(parameters: Mapping[str, object]) -> bool:
    """`RepositoryModelUnload`'s one parameter, `unload_dependents` (a bool); anything else is refused."""
    for key, value in parameters.items():
        if key != "unload_dependents":
            raise InvalidInput(
                f"RepositoryModelUnload: parameter '{echo(key)}' is not supported (only 'unload_dependents')"
            )
        if not isinstance(value, bool):
            raise InvalidInput("RepositoryModelUnload: parameter 'unload_dependents' must be a bool")
    return bool(parameters.get("unload_dependents", False))


def _auth(call: RequestContext, client: StageClient) -> Metadata:
    """The caller's own credentials for the stages (their admin scope is what a load needs there), else the
    router's."""
    caller = tuple((k, v) for k, v in call.metadata if k == "authorization")
    return caller or client.auth


def _forget_unserving(client: StageClient) -> None:
    """A replica that stops serving may come back (a restart) serving something else: until its index is
    read again, it cannot say what it serves, so the replicas that can say take the calls first."""
    for replica in client.replicas.by_address.values():
        if replica.state != SERVING:
            replica.index = None


def _up(client: StageClient) -> list[Replica]:
    return [r for r in client.replicas.by_address.values() if r.state != DOWN]


def _latest(versions: Iterable[str]) -> str:
    """The highest of `versions` (Triton's are integers: numeric order)."""
    return max(versions, key=lambda v: (len(v), v))


async def _rpc(
    client: StageClient, replica: Replica, method: str, request: object, auth: Metadata, timeout: float | None
):
    """One call of one replica, its failure as the router's error naming the replica."""
    name = client.endpoint.name
    try:
        reply = await getattr(replica.stub, method)(request, timeout=timeout, metadata=auth)
    except grpc.aio.AioRpcError as err:
        code, details = err.code(), err.details() or ""
        if client.metrics is not None:
            client.metrics.stage_calls.labels(name, code.name).inc()
        where = f"replica {replica.address} of stage '{name}'"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            raise Unavailable(f"{where} is unavailable: {details}") from None
        raise StageError(f"{where}: {details}", code) from None
    if client.metrics is not None:
        client.metrics.stage_calls.labels(name, "OK").inc()
    return reply


async def _index_of_replica(
    client: StageClient, replica: Replica, auth: Metadata
) -> dict[str, frozenset[str]]:
    reply = await _rpc(client, replica, "RepositoryIndex", pb.RepositoryIndexRequest(ready=True), auth, 10.0)
    return ready_of(reply.models)


async def _served(client: StageClient, replica: Replica, name: str, auth: Metadata) -> Before:
    """What a replica serves of `name` now, asked of it (its READY versions and their config)."""
    ready = await _index_of_replica(client, replica, auth)
    replica.index = ready
    versions = ready.get(name, frozenset())
    if not versions:
        return Before(frozenset(), None)
    reply = await _rpc(client, replica, "ModelConfig", pb.ModelConfigRequest(name=name), auth, 10.0)
    return Before(versions, reply.config)


async def _load_on(
    client: StageClient, replica: Replica, name: str, sent: Parameters, auth: Metadata, timeout: float | None
) -> None:
    """Load `name` on one replica; once loaded, its index is read again at once, so that requests naming no
    version leave it while the fleet version is another."""
    request = pb.RepositoryModelLoadRequest(model_name=name, parameters=sent)
    try:
        await _rpc(client, replica, "RepositoryModelLoad", request, auth, timeout)
    finally:
        # Read even after a failure: a replica that failed keeps serving what it served, and says so.
        try:
            replica.index = await _index_of_replica(client, replica, auth)
        except PipelineError:
            replica.index = None


async def _unload_on(
    client: StageClient, replica: Replica, name: str, auth: Metadata, timeout: float | None
) -> None:
    request = pb.RepositoryModelUnloadRequest(model_name=name)
    try:
        await _rpc(client, replica, "RepositoryModelUnload", request, auth, timeout)
    finally:
        try:
            replica.index = await _index_of_replica(client, replica, auth)
        except PipelineError:
            replica.index = None


async def _restore(client: StageClient, replica: Replica, name: str, before: Before, auth: Metadata) -> None:
    """Put a replica back to what it served: unloaded where it served nothing, else loaded as `_pinned`
    says."""
    if before.config is None:
        await _unload_on(client, replica, name, auth, None)
        return
    await _load_on(client, replica, name, _pinned(before), auth, None)


def _pinned(before: Before) -> Parameters:
    """The load parameters that serve what a replica served: the config it served, its versions pinned
    (`version_policy` specific), whatever its disk holds now."""
    assert before.config is not None
    config = mc.ModelConfig()
    config.CopyFrom(before.config)
    if config.backend:  # the platform a stage reports for a backend's model is not one a config may name
        config.ClearField("platform")
    config.version_policy.specific.versions[:] = sorted(int(v) for v in before.versions if v.isdigit())
    text = json_format.MessageToJson(config, preserving_proto_field_name=True)
    return {"config": pb.ModelRepositoryParameter(string_param=text)}


def _failure(
    rpc: str,
    name: str,
    stage: str,
    failed: Sequence[tuple[Replica, BaseException | None]],
    rolled: Sequence[str],
) -> PipelineError:
    """The error of a change that did not reach every replica: the first failure's code, every failure and
    every roll-back named."""
    errors = [e for _, e in failed if isinstance(e, PipelineError)]
    others = [e for _, e in failed if isinstance(e, BaseException) and not isinstance(e, PipelineError)]
    if others:
        raise others[0]
    reasons = "; ".join(e.message for e in errors)
    back = f"; {', '.join(rolled)}" if rolled else ""
    code = errors[0].code if errors else grpc.StatusCode.INTERNAL
    return StageError(
        f"{rpc} of model '{name}' failed on {len(errors)} replica(s) of stage '{stage}', so on none: {reasons}{back}",
        code,
    )
