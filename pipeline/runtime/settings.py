"""Every setting the processes read from their environment, in one place: its variable, its default and how
its text is read. The services' flags default to these; they are read when a command line is parsed (or a
server starts), never at import, and an empty variable counts as unset (as `${VAR:-default}` does in the
ensemble files and in Compose).

Variables that other tools define keep their own homes: OpenTelemetry's `OTEL_*` (read by its SDK and by
`pipeline.runtime.telemetry`) and the ensemble files' own `${VAR}`s.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """One environment variable: its name, its default, and how its text becomes a value."""

    variable: str
    default: T
    parse: Callable[[str], T]

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value the environment (`os.environ` by default) gives, else the default."""
        text = (os.environ if environ is None else environ).get(self.variable, "").strip()
        return self.parse(text) if text else self.default

    def given(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the environment sets the variable (to something other than blanks)."""
        return bool((os.environ if environ is None else environ).get(self.variable, "").strip())


def byte_count(text: str) -> int:
    """A number of bytes, with an optional k, M or G suffix (powers of 1024): `64M`, `1048576`."""
    text = text.strip()
    scale = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 1048576 or 64M, got {text!r}"
        ) from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"a size cannot be negative, got {text!r}")
    return size


def port_or_off(text: str) -> int | None:
    """A port, 0 for one the OS picks, `off` (or a negative number) for none."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or 'off', got {text!r}") from None
    return None if port < 0 else port


def names(text: str) -> tuple[str, ...]:
    """Comma-separated names, blanks dropped."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def flag(text: str) -> bool:
    """A yes/no variable: anything but 0, false, no and off is yes."""
    return text.strip().lower() not in ("0", "false", "no", "off")


def _optional(text: str) -> str | None:
    return text


#: The services and their default gRPC ports; each serves Prometheus metrics on its port plus 100, the
#: router on 8002 (and HTTP/REST on 8000).
PORTS: Mapping[str, int] = {"router": 8001, "preprocess": 8101, "model": 8102, "postprocess": 8103}
#: The stages, in the order requests pass them.
STAGES = ("preprocess", "model", "postprocess")


def port(service: str) -> Setting[int]:
    """`PIPELINE_<SERVICE>_PORT`: the gRPC port of a service."""
    return Setting(f"PIPELINE_{service.upper()}_PORT", PORTS[service], int)


def metrics_port(service: str) -> Setting[int | None]:
    """`PIPELINE_<SERVICE>_METRICS_PORT`: its Prometheus port (the router's 8002, a stage's its port + 100)."""
    default = 8002 if service == "router" else PORTS[service] + 100
    return Setting(f"PIPELINE_{service.upper()}_METRICS_PORT", default, port_or_off)


def frames_port(service: str) -> Setting[int | None]:
    """`PIPELINE_<SERVICE>_FRAMES_PORT`: a server's frame port (`pipeline.runtime.frame_server`); by default
    one the OS picks (its callers learn it from `ServerMetadata`), fixed where a network policy or a load
    balancer in front of several routers must name it."""
    return Setting(f"PIPELINE_{service.upper()}_FRAMES_PORT", 0, port_or_off)


def stage_address(stage: str) -> Setting[str]:
    """`<STAGE>_ADDRESS`: where the router calls a stage, as the example ensembles' `${..._ADDRESS}` say."""
    return Setting(f"{stage.upper()}_ADDRESS", f"127.0.0.1:{PORTS[stage]}", str)


def load_models(service: str) -> Setting[tuple[str, ...]]:
    """`PIPELINE_<SERVICE>_LOAD_MODEL`: the repository models a stage service serves (Triton's --load-model)."""
    none: tuple[str, ...] = ()
    return Setting(f"PIPELINE_{service.upper()}_LOAD_MODEL", none, names)


# Every service.
HOST = Setting("PIPELINE_HOST", "127.0.0.1", str)
MAX_MESSAGE_MB = Setting("PIPELINE_MAX_MESSAGE_MB", 64, int)
#: The bytes of requests and responses a server holds in flight (`pipeline.runtime.admission`); 0: no limit.
MAX_INFLIGHT_MB = Setting("PIPELINE_MAX_INFLIGHT_MB", 256, int)
GRACE_PERIOD = Setting("PIPELINE_GRACE_PERIOD", 10.0, float)
DRAIN_DELAY = Setting("PIPELINE_DRAIN_DELAY", 1.0, float)
LOG_LEVEL = Setting("PIPELINE_LOG_LEVEL", "INFO", str)
#: Clients reconnect after this long, and so look the server's name up again.
MAX_CONNECTION_AGE_S = Setting("PIPELINE_MAX_CONNECTION_AGE_S", 30.0, float)
MODEL_DIR = Setting("PIPELINE_MODEL_DIR", Path("model_repository"), Path)
ENSEMBLES = Setting("PIPELINE_ENSEMBLES", Path("ensembles"), Path)

# The stage services.
#: Where the models' calls to other models go (Triton's BLS): the router's host:port.
ROUTER: Setting[str | None] = Setting("PIPELINE_ROUTER", None, _optional)

# Security (pipeline.runtime.security).
TLS_CERT: Setting[str | None] = Setting("PIPELINE_TLS_CERT", None, _optional)
TLS_KEY: Setting[str | None] = Setting("PIPELINE_TLS_KEY", None, _optional)
TLS_CA: Setting[str | None] = Setting("PIPELINE_TLS_CA", None, _optional)
TLS_DIR: Setting[Path | None] = Setting("PIPELINE_TLS_DIR", None, Path)
TLS_IDENTITIES: Setting[tuple[str, ...]] = Setting("PIPELINE_TLS_IDENTITIES", (), names)
TLS_ADMIN_IDENTITIES: Setting[tuple[str, ...]] = Setting("PIPELINE_TLS_ADMIN_IDENTITIES", (), names)
AUTH_TOKENS: Setting[str | None] = Setting("PIPELINE_AUTH_TOKENS", None, _optional)
AUTH_TOKENS_FILE: Setting[str | None] = Setting("PIPELINE_AUTH_TOKENS_FILE", None, _optional)
ADMIN_TOKENS: Setting[str | None] = Setting("PIPELINE_ADMIN_TOKENS", None, _optional)
ADMIN_TOKENS_FILE: Setting[str | None] = Setting("PIPELINE_ADMIN_TOKENS_FILE", None, _optional)
STAGE_TOKEN: Setting[str | None] = Setting("PIPELINE_STAGE_TOKEN", None, _optional)
STAGE_TOKEN_FILE: Setting[str | None] = Setting("PIPELINE_STAGE_TOKEN_FILE", None, _optional)

# The router.
HTTP_PORT: Setting[int | None] = Setting("PIPELINE_HTTP_PORT", 8000, port_or_off)
MAX_JSON_OUTPUT_MB = Setting("PIPELINE_MAX_JSON_OUTPUT_MB", 64, int)
HTTP_CODEC_PROCESSES = Setting("PIPELINE_HTTP_CODEC_PROCESSES", 2, int)
MAX_INFLIGHT_REQUESTS = Setting("PIPELINE_MAX_INFLIGHT_REQUESTS", 1024, int)
MAX_BATCH_ITEMS = Setting("PIPELINE_MAX_BATCH_ITEMS", 1024, int)
CACHE_SIZE = Setting("PIPELINE_CACHE_SIZE", 0, byte_count)
ROUTER_WORKERS = Setting("PIPELINE_ROUTER_WORKERS", 1, int)
#: Seconds between look-ups of the stages' DNS names.
RESOLVE_INTERVAL_S = Setting("PIPELINE_RESOLVE_INTERVAL_S", 5.0, float)
#: Triton's `--strict-readiness`: ready only while every ensemble is available and every stage healthy.
STRICT_READINESS = Setting("PIPELINE_STRICT_READINESS", True, flag)
#: Triton's `--exit-on-error`: an ensemble that fails to load stops the router at start-up; false serves the
#: others, the failed one UNAVAILABLE with its reason.
EXIT_ON_ERROR = Setting("PIPELINE_EXIT_ON_ERROR", True, flag)
#: Triton's `--repository-poll-secs`: seconds between looks at the ensemble files for changes (0: never).
REPOSITORY_POLL_SECS = Setting("PIPELINE_REPOSITORY_POLL_SECS", 0.0, float)

# The model service.
ENGINE_CACHE: Setting[str | None] = Setting("PIPELINE_ENGINE_CACHE", None, _optional)
DEVICE = Setting("PIPELINE_DEVICE", "auto", str)
TORCH_THREADS = Setting("PIPELINE_TORCH_THREADS", 1, int)
DISABLE_AUTO_COMPLETE_CONFIG = Setting("PIPELINE_DISABLE_AUTO_COMPLETE_CONFIG", False, flag)
DEFAULT_MAX_BATCH_SIZE = Setting("PIPELINE_DEFAULT_MAX_BATCH_SIZE", 4, int)
STRICT_RUNNER = Setting("PIPELINE_STRICT_RUNNER", False, flag)

# The clients (`pipeline infer`, `pipeline bench`).
URL = Setting("PIPELINE_URL", "127.0.0.1:8001", str)
TOKEN: Setting[str | None] = Setting("PIPELINE_TOKEN", None, _optional)
