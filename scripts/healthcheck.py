"""Container health check: ask a service's gRPC health service (grpc.health.v1) whether it is SERVING.

    python scripts/healthcheck.py [ADDRESS] [--service NAME] [--timeout SECONDS]

ADDRESS defaults to 127.0.0.1 and the port of the service named by PIPELINE_SERVICE (router, preprocess,
model or postprocess), read from PIPELINE_<SERVICE>_PORT as the service itself reads it. Exit status 0
when SERVING, 1 otherwise, with one line saying why: what Docker's HEALTHCHECK and Compose expect.

When the service serves TLS (PIPELINE_TLS_CERT is set), the check connects with TLS too, trusting
PIPELINE_STAGE_TLS_CA (else PIPELINE_TLS_CA) and presenting PIPELINE_STAGE_TLS_CERT/KEY when mutual TLS asks
for a client certificate: the same files the services use.

Only grpcio and grpcio-health-checking are imported (not pipeline._gen), so it starts in a fraction of a
second and works next to any client.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PORTS = {"router": 8001, "preprocess": 8101, "model": 8102, "postprocess": 8103}


def default_address() -> str:
    service = os.environ.get("PIPELINE_SERVICE", "router").lower()
    port = os.environ.get(f"PIPELINE_{service.upper()}_PORT", str(DEFAULT_PORTS.get(service, 8001)))
    return f"127.0.0.1:{port}"


def channel_for(address: str):
    """A plaintext channel, or a TLS one when this container's service serves TLS."""
    import grpc

    env = os.environ.get
    if not env("PIPELINE_TLS_CERT"):
        return grpc.insecure_channel(address)

    def read(name: str) -> bytes | None:
        path = env(name)
        return Path(path).read_bytes() if path else None

    ca = read("PIPELINE_STAGE_TLS_CA") or read("PIPELINE_TLS_CA")
    credentials = grpc.ssl_channel_credentials(
        ca, read("PIPELINE_STAGE_TLS_KEY"), read("PIPELINE_STAGE_TLS_CERT")
    )
    return grpc.secure_channel(address, credentials)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "address", nargs="?", default=None, help="host:port (default: this container's service)"
    )
    parser.add_argument("--service", default="", help="health service name; '' (default) is the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default %(default)s)")
    args = parser.parse_args(argv)
    address = args.address or default_address()

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with channel_for(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as err:
            print(f"unhealthy: {address}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {address}: {status}", file=sys.stderr)
        return 1
    print(f"healthy: {address}: {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
