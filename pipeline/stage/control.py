"""Repository control: who may load and unload models on a stage service, and how many instances a model
may ask for.

`RepositoryModelLoad` and `RepositoryModelUnload` are refused unless the service runs in explicit
model-control mode or has an admin credential configured (`pipeline.runtime.model_control`).

Unlike Triton's explicit mode, the mode does not change what loads at start-up: every service still loads
the models placed on it (or those `--load-model` names), so that `make run` serves the same models in
either mode.

Whatever the mode and whoever asks, a model version gets at most `--max-instances` instances (env
`PIPELINE_MAX_INSTANCES`): each is a thread with its own copy of the model, and a config asking for
hundreds would take the service's memory in a moment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from google.protobuf import json_format

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import InvalidInput, RepositoryError
from pipeline.runtime import server_settings
from pipeline.runtime.model_control import check_control_enabled
from pipeline.runtime.security import AccessPolicy
from pipeline.runtime.server_settings import DEFAULT_MAX_INSTANCES


@dataclass(frozen=True)
class ModelControl:
    """What a stage service allows of repository control (see the module docstring)."""

    #: Started with `--model-control-mode explicit`.
    explicit: bool = False
    #: An admin credential is configured: the authentication interceptor lets only admins through.
    admin_configured: bool = False
    #: The most instances one model version may have.
    max_instances: int = DEFAULT_MAX_INSTANCES

    @property
    def enabled(self) -> bool:
        """Whether `RepositoryModelLoad` and `RepositoryModelUnload` may run at all."""
        return self.explicit or self.admin_configured

    def check_enabled(self, rpc: str) -> None:
        """Raise `ModelControlDisabled`, naming the flags that enable `rpc`, unless control is enabled."""
        check_control_enabled(rpc, explicit=self.explicit, admin_configured=self.admin_configured)

    def check_instances(self, config: mc.ModelConfig, source: str) -> None:
        """`RepositoryError` when the config's `instance_group` asks for more instances than allowed."""
        asked = requested_instances(config)
        if asked > self.max_instances:
            raise RepositoryError(
                f"{source}: instance_group asks for {asked} instances, over the limit of {self.max_instances} "
                "per model version (--max-instances, env PIPELINE_MAX_INSTANCES)"
            )


def requested_instances(config: mc.ModelConfig) -> int:
    """The most instances a config's `instance_group` can give, whichever backend places them: `count` per
    group (at least 1), times the GPUs a group names."""
    groups = list(config.instance_group) or [mc.ModelInstanceGroup(count=1)]
    return sum(max(group.count, 1) * max(len(group.gpus), 1) for group in groups)


def model_control_of(
    control: server_settings.ModelControl, instances: server_settings.Instances, policy: AccessPolicy
) -> ModelControl:
    """The repository control a service's settings and access policy give."""
    return ModelControl(
        explicit=control.explicit,
        admin_configured=policy.admin_configured,
        max_instances=instances.max_instances,
    )


#: The prefix of Triton's file-override parameters of `RepositoryModelLoad`: `file:<version>/<file name>`.
FILE_PARAMETER = "file:"


@dataclass(frozen=True)
class LoadOverride:
    """What `RepositoryModelLoad`'s parameters replace of a model's folder: its `config.pbtxt` (`config`, a
    `ModelConfig` in JSON) and, with file overrides, every file (path within the folder -> its bytes)."""

    config: mc.ModelConfig | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)


def load_override(parameters: Mapping[str, object]) -> LoadOverride:
    """The override that `RepositoryModelLoad`'s parameters give: `config` and `file:<version>/<name>` (as in
    Triton, files need `config`, and the model is then loaded from them alone); anything else is refused."""
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if key.startswith(FILE_PARAMETER):
            path = PurePosixPath(key.removeprefix(FILE_PARAMETER))
            if path.is_absolute() or ".." in path.parts or not path.parts:
                raise InvalidInput(
                    f"RepositoryModelLoad: parameter '{key}' must name a file inside the model"
                )
            if not isinstance(value, bytes):
                raise InvalidInput(f"RepositoryModelLoad: parameter '{key}' must carry the file's bytes")
            files[str(path)] = value
        elif key != "config":
            raise InvalidInput(
                f"RepositoryModelLoad: parameter '{key}' is not supported (only 'config' and 'file:...')"
            )
    if "config" not in parameters:
        if files:
            raise InvalidInput("RepositoryModelLoad: file overrides need the parameter 'config' too")
        return LoadOverride()
    try:
        config = json_format.Parse(str(parameters["config"]), mc.ModelConfig())
    except json_format.ParseError as exc:
        raise InvalidInput(
            f"RepositoryModelLoad: parameter 'config' is not a ModelConfig in JSON: {exc}"
        ) from None
    return LoadOverride(config, files)
