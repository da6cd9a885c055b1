"""Ports on 127.0.0.1 for the servers the benchmarks and tests start.

A port the kernel hands out for ``bind(port 0)`` comes from its ephemeral range, and so
does every port Ray's processes take for themselves (the GCS, the raylet, each worker's
gRPC server). A server started after such a pick can find the port taken by a Ray
process that started in between: a chaos run's readiness probe once got a binary,
non-HTTP reply there. So ports are drawn below that range, where nothing binds port 0.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
_LOWEST = 20000            # above the ports servers default to (8000, 8265, 6379, ...)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768       # Linux's default


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now, below the ephemeral range (all bound at
    once, so no two are the same); where that range starts too low to leave room, the
    kernel's own picks."""
    top = _ephemeral_start()
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(_bind_one(rng, top))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _bind_one(rng: random.Random, top: int) -> socket.socket:
    s = socket.socket()
    for _ in range(64 if top - _LOWEST >= 1000 else 0):
        try:
            s.bind((HOST, rng.randrange(_LOWEST, top)))
            return s
        except OSError:
            continue
    s.bind((HOST, 0))
    return s
