"""Where a stage is: gRPC's target syntax taken apart, and the DNS look-up of a stage's name.

A stage address names fixed replicas (`ipv4:`/`ipv6:` lists, `unix:` paths), a DNS name that the router
looks up again and again (`dns:///host:port`, plain `host:port`), or a file of addresses it reads again and
again (`file:PATH`, one `host:port` a line: what `pipeline run --autoscale` writes as it adds and removes
replicas), so that replicas may come and go.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

#: How a stage target's addresses are found: `(host, port) -> ["ip:port", ...]`. Tests inject their own.
Resolve = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(host: str, port: int) -> list[str]:
    """The addresses of `host` (asyncio's getaddrinfo): its IPv4 addresses, or its IPv6 ones if it has none
    (`localhost` resolving to both would otherwise count one server as two replicas)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
    v6 = [info[4][0] for info in infos if info[0] == socket.AF_INET6]
    if v4:
        return [f"{ip}:{port}" for ip in dict.fromkeys(v4)]
    return [f"[{ip}]:{port}" for ip in dict.fromkeys(v6)]


async def read_addresses(path: str, port: int = 0) -> list[str]:
    """The addresses a file lists, one `host:port` a line (blank lines and `#` comments skipped); `OSError`
    where it cannot be read (the replicas known are kept)."""
    text = await asyncio.to_thread(Path(path).read_text)
    lines = (line.partition("#")[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


@dataclass(frozen=True, slots=True)
class Target:
    """A stage address taken apart: fixed replica addresses, or a DNS name to look up again and again."""

    #: `ipv4:`/`ipv6:` lists and `unix:` paths: the replicas, once and for all.
    fixed: tuple[str, ...] = ()
    host: str = ""
    port: int = 0
    #: A file of addresses, read again and again (its `host`: the path, to look it up as a name is).
    file: bool = False

    @classmethod
    def parse(cls, address: str) -> Target:
        """Read gRPC's target syntax: `ipv4:a:p,b:p`, `ipv6:[a]:p,...`, `dns:///host:port` (or
        `dns://authority/host:port`), `unix:path`, or a plain `host:port` (looked up by name)."""
        scheme, sep, rest = address.partition(":")
        if sep and scheme in ("ipv4", "ipv6"):
            return cls(fixed=tuple(f"{scheme}:{a.strip()}" for a in rest.split(",") if a.strip()))
        if sep and scheme in ("unix", "unix-abstract"):
            return cls(fixed=(address,))
        if sep and scheme == "file":
            return cls(host=rest, file=True)
        name = address
        if sep and scheme == "dns":
            name = rest[2:].partition("/")[2] if rest.startswith("//") else rest
        host, port = _host_port(name)
        return cls(host=host, port=port)


def _host_port(name: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`; gRPC's default port (443) when none is given."""
    if name.startswith("["):
        host, _, tail = name[1:].partition("]")
        return host, int(tail[1:]) if tail.startswith(":") else 443
    host, sep, port = name.rpartition(":")
    if not sep:
        return name, 443
    return host, int(port)


def tls_name(address: str) -> str | None:
    """The name a stage's certificate must carry: the host of its target (for an `ipv4:a,b` list, the
    first host stands for every replica), since each replica's own channel dials an IP address."""
    target = Target.parse(address)
    if target.file:
        return None  # each replica's own address is verified
    if target.fixed:
        first = target.fixed[0].partition(":")[2]
        if address.startswith("unix"):
            return None
        return _host_port(first)[0] if ":" in first else first
    return target.host
