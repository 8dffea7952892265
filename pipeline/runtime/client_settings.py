"""How a client reaches a server (`pipeline infer`, `pipeline bench`): its address, its bearer token and its
TLS files, each from its flag, else its variable (`PIPELINE_URL`, `PIPELINE_TOKEN`,
`PIPELINE_CLIENT_TLS_*`), else the default."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel

from pipeline.runtime.settings_cli import option
from pipeline.runtime.settings_values import CLIENT_TLS_HELP, PORTS


class Client(BaseModel):
    """The server a client calls, and how: a group of `pipeline infer`'s and `pipeline bench`'s settings."""

    url: Annotated[
        str,
        option(
            "--url",
            "-u",
            env="PIPELINE_URL",
            help="host:port of the server: the router, or any OIP endpoint (a stage over gRPC, the router's "
            "HTTP port for `pipeline bench --protocol http`) (env PIPELINE_URL; default %(default)s)",
        ),
    ] = f"127.0.0.1:{PORTS['router']}"
    tls_ca: Annotated[
        str | None,
        option(
            "--tls-ca",
            env="PIPELINE_CLIENT_TLS_CA",
            help=f"{CLIENT_TLS_HELP['ca']} (env PIPELINE_CLIENT_TLS_CA)",
        ),
    ] = None
    tls_cert: Annotated[
        str | None,
        option(
            "--tls-cert",
            env="PIPELINE_CLIENT_TLS_CERT",
            help=f"{CLIENT_TLS_HELP['cert']} (env PIPELINE_CLIENT_TLS_CERT)",
        ),
    ] = None
    tls_key: Annotated[
        str | None,
        option(
            "--tls-key",
            env="PIPELINE_CLIENT_TLS_KEY",
            help=f"{CLIENT_TLS_HELP['key']} (env PIPELINE_CLIENT_TLS_KEY)",
        ),
    ] = None
    token: Annotated[
        str | None,
        option(
            "--token",
            env="PIPELINE_TOKEN",
            help="bearer token sent with every call, for a server that asks for one (env PIPELINE_TOKEN)",
        ),
    ] = None
