"""How the settings' text becomes values (the flags' and the variables' parsers, shared by every
settings model), the services' default ports, and the variables that no server flag sets (`Setting`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from pipeline.runtime.settings_cli import read_variable, variable_text

T = TypeVar("T")


class SettingValueError(argparse.ArgumentTypeError, ValueError):
    """A value a setting does not take: argparse shows its message for a flag, and a settings model refuses
    it (a `ValueError` to pydantic) where it is given in code."""


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


#: A boolean's spellings, as Triton reads its boolean flags (`--exit-on-error=false`).
BOOLEANS = {
    "true": True,
    "1": True,
    "on": True,
    "yes": True,
    "false": False,
    "0": False,
    "off": False,
    "no": False,
}


def boolean(text: str) -> bool:
    """An argparse type: a boolean as Triton's flags take it (true, false, 1, 0; on, off, yes, no)."""
    try:
        return BOOLEANS[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true or false (or 1 or 0), got {text!r}") from None


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def non_negative_int(value: str) -> int:
    """An argparse type: an integer of at least 0."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def identities(text: str) -> frozenset[str]:
    """An argparse type: comma-separated certificate identities."""
    return frozenset(names(text))


def stage_argument(value: str) -> tuple[str, str]:
    """An argparse type: `NAME=ADDRESS`."""
    name, sep, address = value.partition("=")
    if not sep or not name.strip() or not address.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=ADDRESS (e.g. model=127.0.0.1:8102), got {value!r}")
    return name.strip(), address.strip()


def paths(text: str) -> list[Path]:
    """A variable that names one path, as the value of a flag that takes several."""
    return [Path(text)]


#: Triton's model control modes that the services take (`poll` is not one: nothing here polls).
MODEL_CONTROL_MODES = ("none", "explicit")


def control_mode(value: str) -> str:
    """An argparse type: one of `MODEL_CONTROL_MODES`."""
    mode = value.strip().lower() or "none"
    if mode not in MODEL_CONTROL_MODES:
        raise argparse.ArgumentTypeError(
            f"model control mode must be one of {', '.join(MODEL_CONTROL_MODES)}, got {value!r}"
        )
    return mode


#: Where the model service's instances of kind KIND_AUTO may go (or `cuda:N`).
DEVICES = ("auto", "cpu", "cuda")


def device_name(value: str) -> str:
    """An argparse type (and a settings model's check): one of `DEVICES`, or `cuda:N`."""
    if value not in DEVICES and not (value.startswith("cuda:") and value[5:].isdigit()):
        raise SettingValueError(f"unknown device {value!r}; expected one of {', '.join(DEVICES)} or cuda:N")
    return value


#: The services and their default gRPC ports; each serves Prometheus metrics on its port plus 100, the
#: router on 8002 (and HTTP/REST on 8000).
PORTS: Mapping[str, int] = {"router": 8001, "preprocess": 8101, "model": 8102, "postprocess": 8103}


#: The stages, in the order requests pass them.
STAGES = ("preprocess", "model", "postprocess")


#: What each of a client's TLS files is for (the router's `--stage-tls-*`, the clients' `--tls-*`).
CLIENT_TLS_HELP = {
    "ca": "PEM CA that signed the server's certificate (turns TLS on)",
    "cert": "PEM client certificate, for servers that require one (mutual TLS)",
    "key": "PEM key of the client certificate",
}


# --- the variables no server flag sets ------------------------------------------------------------------
# Read where they are used, as the settings models' variables are (`pipeline.runtime.settings_cli.read_variable`).


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """One environment variable that no server flag sets: its name, its default, and how its text becomes a
    value (read as the settings models' variables are: `pipeline.runtime.settings_cli.read_variable`)."""

    variable: str
    default: T
    parse: Callable[[str], T]

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value the environment (`os.environ` by default) gives, else the default; `SettingError` names
        a variable that does not parse."""
        given, value = read_variable(self.variable, self.parse, environ)
        return value if given else self.default

    def given(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the environment sets the variable (to something other than blanks)."""
        return bool(variable_text(self.variable, environ))


def optional(text: str) -> str | None:
    return text


def stage_address(stage: str) -> Setting[str]:
    """`<STAGE>_ADDRESS`: where the router calls a stage, as the example ensembles' `${..._ADDRESS}` say."""
    return Setting(f"{stage.upper()}_ADDRESS", f"127.0.0.1:{PORTS[stage]}", str)


#: Clients reconnect after this long, and so look the server's name up again.
MAX_CONNECTION_AGE_S = Setting("PIPELINE_MAX_CONNECTION_AGE_S", 30.0, float)
#: The model repository of the tools that read one (the services' is their `--model-dir`).
MODEL_DIR = Setting("PIPELINE_MODEL_DIR", Path("model_repository"), Path)
#: Seconds between look-ups of the stages' DNS names (the router's `--resolve-interval`).
RESOLVE_INTERVAL_S = Setting("PIPELINE_RESOLVE_INTERVAL_S", 5.0, float)
# Security (pipeline.runtime.security): the tokens' lists, and the router's token for its stages.
AUTH_TOKENS: Setting[str | None] = Setting("PIPELINE_AUTH_TOKENS", None, optional)
AUTH_TOKENS_FILE: Setting[str | None] = Setting("PIPELINE_AUTH_TOKENS_FILE", None, optional)
ADMIN_TOKENS: Setting[str | None] = Setting("PIPELINE_ADMIN_TOKENS", None, optional)
ADMIN_TOKENS_FILE: Setting[str | None] = Setting("PIPELINE_ADMIN_TOKENS_FILE", None, optional)
STAGE_TOKEN: Setting[str | None] = Setting("PIPELINE_STAGE_TOKEN", None, optional)
STAGE_TOKEN_FILE: Setting[str | None] = Setting("PIPELINE_STAGE_TOKEN_FILE", None, optional)
# The clients (`pipeline infer`, `pipeline bench`).
URL = Setting("PIPELINE_URL", "127.0.0.1:8001", str)
TOKEN: Setting[str | None] = Setting("PIPELINE_TOKEN", None, optional)
