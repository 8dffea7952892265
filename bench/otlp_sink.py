"""A local OTLP/HTTP receiver that accepts every span export and keeps nothing: the least a collector costs
the machine, so that a run with tracing on pays a receiver on the same cores, as it would in production.

    python -m bench.otlp_sink --port-file FILE     # answers POST /v1/traces (and /v1/metrics, /v1/logs)
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from pathlib import Path

from aiohttp import web


async def _accept(request: web.Request) -> web.Response:
    await request.read()
    # An empty ExportTraceServiceResponse: nothing rejected.
    return web.Response(body=b"", content_type="application/x-protobuf")


async def _serve(sock: socket.socket) -> None:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    for path in ("/v1/traces", "/v1/metrics", "/v1/logs"):
        app.router.add_post(path, _accept)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.otlp_sink", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port-file", type=Path, required=True, help="where the bound port is written")
    args = parser.parse_args()
    sock = socket.create_server(("127.0.0.1", 0))
    args.port_file.write_text(f"{sock.getsockname()[1]}\n")
    asyncio.run(_serve(sock))


if __name__ == "__main__":
    main()
