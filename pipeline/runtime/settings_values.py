"""How the settings' text becomes values (the flags' and the variables' parsers, shared by every
settings model), and the defaults that several settings models share (the services' ports, ...)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

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


#: Clients reconnect after this long (`Limits.max_connection_age_s`), and so look the server's name up again.
DEFAULT_MAX_CONNECTION_AGE_S = 30.0
#: Seconds between look-ups of the stages' DNS names (the router's `--resolve-interval`).
DEFAULT_RESOLVE_INTERVAL_S = 5.0
#: The model repository a process reads where no `--model-dir` names one.
DEFAULT_MODEL_DIR = Path("model_repository")
