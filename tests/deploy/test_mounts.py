"""Every deployment mounts what its processes read and write: Kubernetes' Deployments (deploy/k8s),
compose.yaml and the Swarm stack (compose.swarm.yaml).

What a process reads is not listed here: each container's command is parsed by the service's own command
line parser, under the environment the process gets (the image's `ENV` from the Dockerfile, then the
deployment's), so a flag or variable that names a path is checked wherever it is set. Every path it reads
(the model repository, the ensembles, TLS files, token files) must lie under a mount or be built into the
image (a Dockerfile `COPY`); every path it writes (the engine cache, port files) must lie under a writable
mount. The Swarm stack once ran its router with `PIPELINE_MODEL_DIR=/models` (from the image) and no
volume there; that is the kind of mistake these tests catch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from unittest import mock

import pytest
import yaml

from pipeline.router.main import add_router_arguments
from pipeline.stage.service import python_service_parser
from services.model.__main__ import build_parser as model_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
ENSEMBLES_CONFIGMAP = "pipeline-ensembles"

Doc = dict[str, Any]


# --- the images: the Dockerfile's stages ---------------------------------------------------------------


@dataclass
class Stage:
    """One `FROM ... AS name` stage: what it inherits and adds."""

    base: str
    env: dict[str, str] = field(default_factory=dict)
    copied: list[str] = field(default_factory=list)
    workdir: str = "/"
    cmd: list[str] = field(default_factory=list)


def dockerfile_stages(path: Path = ROOT / "Dockerfile") -> dict[str, Stage]:
    """The Dockerfile's stages by name, with their ENV, COPY destinations, WORKDIR and CMD."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in text.splitlines():
        words = line.split(maxsplit=1)
        if not words or words[0].startswith("#"):
            continue
        instruction, rest = words[0].upper(), words[1] if len(words) > 1 else ""
        if instruction == "FROM":
            base, _, name = rest.partition(" AS ")
            stage = stages.setdefault(name.strip() or base.strip(), Stage(base.strip()))
        elif stage is None:
            continue
        elif instruction == "ENV":
            stage.env.update(word.split("=", 1) for word in shlex.split(rest))  # type: ignore[misc]
        elif instruction == "COPY":
            stage.copied.append([w for w in shlex.split(rest) if not w.startswith("--")][-1])
        elif instruction == "WORKDIR":
            stage.workdir = rest.strip()
        elif instruction == "CMD":
            stage.cmd = json.loads(rest)
    return stages


STAGES = dockerfile_stages()


@dataclass
class Image:
    """What a target's image holds: its environment, the paths it copies in, its working folder, its CMD."""

    env: dict[str, str]
    copied: list[str]
    workdir: str
    cmd: list[str]


def image_of(reference: str) -> Image:
    """The Dockerfile target an image reference names (`pipeline-router:latest` is the target `router`)."""
    target = reference.rsplit("/", 1)[-1].split(":")[0].removeprefix("pipeline-")
    assert target in STAGES, f"image {reference!r}: the Dockerfile has no target {target!r}"
    chain = []
    name = target
    while name in STAGES:
        chain.append(STAGES[name])
        name = STAGES[name].base
    env: dict[str, str] = {}
    copied: list[str] = []
    for stage in reversed(chain):
        env.update(stage.env)
        copied += stage.copied
    workdir = next((s.workdir for s in chain if s.workdir != "/"), "/")
    cmd = next((s.cmd for s in chain if s.cmd), [])
    return Image(env, copied, workdir, cmd)


# --- what a process reads and writes: its own parser, under its environment -----------------------------


def _parser(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]] | None:
    """The command line parser of a pipeline service and the arguments it parses; None for other programs."""
    if argv[:2] == ["pipeline", "router"]:
        parser = argparse.ArgumentParser()
        add_router_arguments(parser)
        return parser, argv[2:]
    if argv[:2] == ["python", "-m"] and len(argv) > 2:
        module, args = argv[2], argv[3:]
        if module == "services.model":
            return model_parser(), args
        if module in ("services.preprocess", "services.postprocess"):
            return python_service_parser(module.split(".")[1]), args
    return None


#: Options that name a path even when it is relative (to the process' working folder).
PATH_OPTIONS = ("_dir", "_file", "_cert", "_key", "_ca", "_cache", "ensembles")


def _paths(option: str, value: object, workdir: str) -> Iterator[str]:
    """The absolute paths an option's value names."""
    if isinstance(value, list | tuple):
        for item in value:
            yield from _paths(option, item, workdir)
    elif isinstance(value, Path) or (isinstance(value, str) and option.endswith(PATH_OPTIONS)):
        yield str(PurePosixPath(workdir, value))
    elif isinstance(value, str) and value.startswith("/"):
        yield value


#: Options whose path the process writes; every other path-valued option is read.
WRITTEN = {"engine_cache", "port_file", "metrics_port_file", "http_port_file"}


@dataclass
class Process:
    """The absolute paths a service process reads and writes."""

    reads: dict[str, list[str]]
    writes: dict[str, list[str]]


def process_of(argv: list[str], env: dict[str, str], workdir: str) -> Process | None:
    """Parse `argv` as the service would with `env` as its whole environment. A service reads the ensembles
    only where their folder exists, so here every path is taken to exist: the tests check that it will."""
    with mock.patch.dict(os.environ, env, clear=True), mock.patch.object(Path, "exists", lambda _: True):
        found = _parser(argv)
        if found is None:
            return None
        parser, args = found
        namespace = parser.parse_args(args)
    reads: dict[str, list[str]] = {}
    writes: dict[str, list[str]] = {}
    for option, value in vars(namespace).items():
        paths = list(_paths(option, value, workdir))
        if paths:
            (writes if option in WRITTEN else reads)[option] = paths
    if "engine_cache" in vars(namespace) and "engine_cache" not in writes:
        # Without one, the model service builds its engines into <model-dir>/.engines.
        writes["engine_cache"] = [str(PurePosixPath(reads["model_dir"][0], ".engines"))]
    if env.get("PIPELINE_STAGE_TOKEN_FILE"):
        reads["PIPELINE_STAGE_TOKEN_FILE"] = [env["PIPELINE_STAGE_TOKEN_FILE"]]
    return Process(reads, writes)


def under(path: str, folder: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(folder.rstrip("/") or "/"))


# --- the deployments, in one shape ----------------------------------------------------------------------


@dataclass
class Mount:
    target: str
    source: str  # a volume, a host path, a ConfigMap, a claim
    writable: bool


@dataclass
class Container:
    """One service's container as a deployment describes it."""

    where: str
    image: Image
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]

    def process(self) -> Process | None:
        return process_of(self.argv, {**self.image.env, **self.env}, self.image.workdir)

    def mount_at(self, path: str) -> Mount | None:
        """The mount that holds `path` (the innermost one), or None."""
        holding = [m for m in self.mounts if under(path, m.target)]
        return max(holding, key=lambda m: len(m.target), default=None)


def kubernetes_containers() -> list[Container]:
    found = []
    for manifest in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(manifest.read_text()):
            if not doc or doc["kind"] != "Deployment":
                continue
            pod = doc["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for container in pod["containers"]:
                mounts = []
                for mount in container.get("volumeMounts", []):
                    volume = volumes[mount["name"]]
                    kind = next(k for k in volume if k != "name")
                    source = volume[kind].get("name") or volume[kind].get("claimName") or kind
                    read_only = mount.get("readOnly", False) or kind in ("configMap", "secret")
                    read_only = read_only or bool(volume[kind].get("readOnly"))
                    mounts.append(Mount(mount["mountPath"], f"{kind}:{source}", not read_only))
                env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
                image = image_of(container["image"])
                argv = [*container.get("command", image.cmd), *container.get("args", [])]
                name = f"{manifest.name}: {doc['metadata']['name']}/{container['name']}"
                found.append(Container(name, image, argv, env, mounts))
    return found


def expand_defaults(value: object) -> str:
    """A Compose value with every `${VAR:-default}` at its default and every `${VAR}` empty."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", str(value))


def compose_containers(file: str) -> list[Container]:
    services = yaml.safe_load((ROOT / file).read_text())["services"]
    found = []
    for name, service in services.items():
        if not service.get("image", "").startswith("pipeline-") or service.get("profiles"):
            continue  # Prometheus and the like
        mounts = []
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):
                mounts.append(Mount(volume["target"], volume["source"], not volume.get("read_only")))
                continue
            source, target, *mode = expand_defaults(volume).split(":")
            mounts.append(Mount(target, source, "ro" not in mode))
        environment = service.get("environment", {})
        env = {key: expand_defaults(value) for key, value in environment.items()}
        image = image_of(service["image"])
        command = service.get("command", image.cmd)
        argv = shlex.split(command) if isinstance(command, str) else command
        found.append(Container(f"{file}: {name}", image, argv, env, mounts))
    return found


CONTAINERS = [
    *kubernetes_containers(),
    *compose_containers("compose.yaml"),
    *compose_containers("compose.swarm.yaml"),
]
SERVICES = [c for c in CONTAINERS if c.process() is not None]


def ids(containers: Iterable[Container]) -> list[str]:
    return [c.where for c in containers]


# --- the checks -----------------------------------------------------------------------------------------


def unmounted_reads(container: Container) -> list[str]:
    """The paths the container's process reads that neither a mount nor the image provides."""
    process = container.process()
    assert process is not None
    missing = []
    for option, paths in process.reads.items():
        for path in paths:
            in_image = any(under(path, copied) for copied in container.image.copied)
            if container.mount_at(path) is None and not in_image:
                missing.append(f"{option}={path}")
    return missing


def unwritable_writes(container: Container) -> list[str]:
    """The paths the container's process writes that no writable mount holds."""
    process = container.process()
    assert process is not None
    return [
        f"{option}={path}"
        for option, paths in process.writes.items()
        for path in paths
        if not ((mount := container.mount_at(path)) and mount.writable)
    ]


def test_every_service_of_every_deployment_is_found() -> None:
    by_file = {where.split(":")[0] for where in ids(SERVICES)}
    assert by_file == {"router.yaml", "preprocess.yaml", "model.yaml", "postprocess.yaml"} | {
        "compose.yaml",
        "compose.swarm.yaml",
    }
    assert len(SERVICES) == 12, ids(SERVICES)


@pytest.mark.parametrize("container", SERVICES, ids=ids(SERVICES))
def test_what_a_service_reads_is_mounted_or_in_its_image(container: Container) -> None:
    assert unmounted_reads(container) == []


@pytest.mark.parametrize("container", SERVICES, ids=ids(SERVICES))
def test_what_a_service_writes_is_on_a_writable_mount(container: Container) -> None:
    assert unwritable_writes(container) == []


@pytest.mark.parametrize("container", SERVICES, ids=ids(SERVICES))
def test_every_service_reads_the_model_repository_from_a_read_only_mount(container: Container) -> None:
    process = container.process()
    assert process is not None
    (model_dir,) = process.reads["model_dir"]  # the router too: its config.pbtxt ensembles
    mount = container.mount_at(model_dir)
    assert mount is not None, f"{container.where}: no model repository at {model_dir}"
    assert not mount.writable, f"{container.where}: the model repository is mounted writable"


def deployment_of(container: Container) -> str:
    file = container.where.split(":")[0]
    return file if file.startswith("compose") else "deploy/k8s"


@pytest.mark.parametrize("deployment", ["deploy/k8s", "compose.yaml", "compose.swarm.yaml"])
def test_the_services_of_a_deployment_share_one_repository(deployment: str) -> None:
    group = [c for c in SERVICES if deployment_of(c) == deployment]
    sources = set()
    for container in group:
        process = container.process()
        assert process is not None
        mount = container.mount_at(process.reads["model_dir"][0])
        assert mount is not None
        sources.add(mount.source)
    assert len(group) == 4 and len(sources) == 1, sources


def test_kubernetes_services_read_the_ensembles_from_the_configmap() -> None:
    """The image's copy of ensembles/ is the one of its build; the ConfigMap is what `make k8s` keeps in
    step with ensembles/, so whoever reads ensembles reads that."""
    readers = set()
    for container in SERVICES:
        if deployment_of(container) != "deploy/k8s":
            continue
        process = container.process()
        assert process is not None
        for path in process.reads.get("ensembles", []):
            mount = container.mount_at(path)
            assert mount is not None and mount.source == f"configMap:{ENSEMBLES_CONFIGMAP}", container.where
            readers.add(container.where.split(":")[0])
    assert readers == {"router.yaml", "preprocess.yaml", "postprocess.yaml"}


def test_compose_fills_the_example_repository_before_the_services_start_and_never_a_users_folder() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    writer = services["model-repository"]
    assert image_of(writer["image"]).cmd[-1] == "/models"
    assert writer["volumes"] == ["model-repository:/models"], "it writes the example volume alone"
    assert writer["restart"] == "no"
    for name in ("router", "preprocess", "model", "postprocess"):
        service = services[name]
        condition = service["depends_on"]["model-repository"]["condition"]
        assert condition == "service_completed_successfully", name
        repository = next(v for v in service["volumes"] if v.endswith(":/models:ro"))
        assert repository == "${PIPELINE_MODEL_REPOSITORY:-model-repository}:/models:ro", name


# --- the checks catch what they are meant to --------------------------------------------------------------


def _router(env: dict[str, str], mounts: list[Mount]) -> Container:
    return Container("router", image_of("pipeline-router"), ["pipeline", "router"], env, mounts)


@pytest.mark.parametrize(
    ("env", "mounts", "check", "expected"),
    [
        # compose.swarm.yaml's router before: PIPELINE_MODEL_DIR=/models from the image, no volume there.
        ({}, [], unmounted_reads, ["model_dir=/models"]),
        ({}, [Mount("/models", "model-repository", False)], unmounted_reads, []),
        (
            {"PIPELINE_TLS_CERT": "/etc/tls/tls.crt", "PIPELINE_TLS_KEY": "/etc/tls/tls.key"},
            [Mount("/models", "model-repository", False)],
            unmounted_reads,
            ["tls_cert=/etc/tls/tls.crt", "tls_key=/etc/tls/tls.key"],
        ),
        (
            {"PIPELINE_STAGE_TOKEN_FILE": "/run/secrets/stage-token"},
            [Mount("/models", "model-repository", False), Mount("/run/secrets", "secret:token", False)],
            unmounted_reads,
            [],
        ),
        (
            {"PIPELINE_ENSEMBLES": "/etc/pipeline/ensembles"},
            [],
            unmounted_reads,
            [
                "model_dir=/models",
                "ensembles=/etc/pipeline/ensembles",
            ],
        ),
    ],
)
def test_the_checks_find_what_is_not_mounted(
    env: dict[str, str], mounts: list[Mount], check: Callable[[Container], list[str]], expected: list[str]
) -> None:
    assert sorted(check(_router(env, mounts))) == sorted(expected)


def test_a_model_service_without_an_engine_cache_writes_into_its_repository() -> None:
    model = Container(
        "model",
        image_of("pipeline-model"),
        ["python", "-m", "services.model"],
        {"PIPELINE_ENGINE_CACHE": ""},
        [Mount("/models", "model-repository", False)],
    )
    assert unwritable_writes(model) == ["engine_cache=/models/.engines"]
