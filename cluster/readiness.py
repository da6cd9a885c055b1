"""What ``/health`` answers: ready only while the control plane can serve.

Not ready while the scheduler does not answer (its process died and Ray is restarting
it), while a restarted scheduler is still taking over its workers, or with no live
worker; ready again as soon as requests can run.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.client_errors import unavailable

_PROBE_TIMEOUT_S = 5.0


async def health(client: Any) -> tuple[int, dict[str, Any]]:
    """The HTTP status and body of ``/health`` for a ``ClusterClient``."""
    try:
        stats = await asyncio.wait_for(client.astats(), _PROBE_TIMEOUT_S)
    except Exception as e:
        return 503, {"status": "unavailable", "reason": unavailable("/health", e)}
    if stats.recovering:
        return 503, {"status": "unavailable",
                     "reason": "the scheduler restarted and is taking over its workers"}
    alive = len(stats.live())
    if not alive:
        return 503, {"status": "unavailable", "reason": "no live worker"}
    return 200, {"status": "ok", "workers_alive": alive}
