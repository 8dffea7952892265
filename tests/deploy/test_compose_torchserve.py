"""compose.torchserve.yaml over compose.yaml: a TorchServe model store served as it is. The one-shot
`model-store` writes the archives' folders into the repository every service reads, before they start; the
folders name the archives under the store's mount, which every service has; the router registers from
the store, into a repository it may write, while the stages read it read-only."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any
from unittest import mock

import yaml

from pipeline.tools import model_store
from tests.deploy.test_mounts import ROOT, expand_defaults, image_of

SERVICES = ("preprocess", "model", "postprocess", "router")


def merged() -> dict[str, Any]:
    """compose.yaml with compose.torchserve.yaml over it, as Compose merges them: mappings key by key,
    volumes by their target, the environment and dependencies by name."""
    base = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    override = yaml.safe_load((ROOT / "compose.torchserve.yaml").read_text())["services"]
    services = {name: dict(service) for name, service in base.items()}
    for name, service in override.items():
        target = services.setdefault(name, {})
        for key, value in service.items():
            if key == "volumes":
                by_target = {_mount(v)[1]: v for v in target.get("volumes", [])}
                by_target.update({_mount(v)[1]: v for v in value})
                target["volumes"] = list(by_target.values())
            elif isinstance(value, dict):
                target[key] = {**target.get(key, {}), **value}
            else:
                target[key] = value
    return services


def _mount(volume: str) -> tuple[str, str, bool]:
    source, target, *mode = expand_defaults(volume).split(":")
    return source, target, "ro" not in mode


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Target -> (source, writable)."""
    return {target: (source, writable) for source, target, writable in map(_mount, service["volumes"])}


def test_the_one_shot_writes_the_repository_every_service_reads_before_they_start() -> None:
    services = merged()
    writer = services["model-store"]
    assert image_of(writer["image"]).cmd == ["pipeline", "router"]  # the router's image: the project's code
    assert writer["build"]["target"] == "router" and writer["restart"] == "no"
    assert writer["depends_on"] == {"model-repository": {"condition": "service_completed_successfully"}}
    env = {key: expand_defaults(value) for key, value in writer["environment"].items()}
    argv = writer["command"]
    assert argv[:3] == ["python", "-m", "pipeline.tools.model_store"]
    # The one-shot's own parser, under its environment: where it reads the store and writes the folders.
    with (
        mock.patch.dict("os.environ", env, clear=True),
        mock.patch.object(model_store, "write_store_models") as w,
    ):
        assert model_store.main(argv[3:]) == 0
    args, repository = w.call_args.args
    assert (str(args.model_store), args.models, str(repository)) == ("/model-store", "all", "/models")
    written = mounts(writer)
    assert written[str(repository)][1], "it writes the repository"
    assert written[str(args.model_store)] == ("./model_store", False)
    for name in SERVICES:
        service = services[name]
        assert service["depends_on"]["model-store"] == {"condition": "service_completed_successfully"}, name
        found = mounts(service)
        # The same repository the one-shot wrote, and the store where the folders say their archives are.
        assert found["/models"][0] == written["/models"][0], name
        assert found["/model-store"] == ("./model_store", False), name
        assert found["/models"][1] == (name == "router"), name  # only the router writes (register)


def test_the_router_registers_from_the_store_it_mounts() -> None:
    router = merged()["router"]
    store = PurePosixPath(expand_defaults(router["environment"]["PIPELINE_MODEL_STORE"]))
    assert str(store) in mounts(router)
    # compose.yaml's other settings of the router stay (the override adds, it does not replace).
    assert router["environment"]["PIPELINE_MODEL_DIR"] == "/models"
    assert "${PIPELINE_ENSEMBLES_DIR:-./ensembles}:/app/ensembles:ro" in router["volumes"]
