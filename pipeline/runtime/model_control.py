"""Whether a server lets `RepositoryModelLoad` and `RepositoryModelUnload` run: Triton's model-control mode.

As in Triton, they are refused unless the server was started in explicit model-control mode
(`--model-control-mode explicit`, env `PIPELINE_MODEL_CONTROL_MODE`; `none` is the default, Triton's too).
Configuring an admin credential (an admin token, or client certificates listed in `--tls-admin-identities`)
enables them as well: the admin scope is then what a caller needs (`pipeline.runtime.security`). Without
either, anyone who reaches a port could unload a model, or reload one with a `config` that lifts its limits.
The stage services and the router (which loads and unloads across every replica of a stage) read the same
flag.
"""

from __future__ import annotations

import grpc

from pipeline.protocol.errors import PipelineError


class ModelControlDisabled(PipelineError):
    """A repository-control RPC on a server that does not allow it: not a matter of credentials (the caller
    cannot fix it), but of how the server was started."""

    code = grpc.StatusCode.FAILED_PRECONDITION


def check_control_enabled(rpc: str, *, explicit: bool, admin_configured: bool) -> None:
    """Raise `ModelControlDisabled`, naming the flags that enable `rpc`, unless the server runs in explicit
    mode or has an admin credential configured."""
    if not (explicit or admin_configured):
        raise ModelControlDisabled(
            f"{rpc} is not allowed: this service runs with model control mode 'none' (the default, as in "
            "Triton); start it with --model-control-mode explicit (env PIPELINE_MODEL_CONTROL_MODE) or "
            "with an admin token (--admin-tokens-file) to load and unload models"
        )
