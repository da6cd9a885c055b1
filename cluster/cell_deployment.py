"""The Serve deployment that owns one cell: ``LLMCell``, and what routers learn of it.

One replica launches the cell (worker actors and global scheduler, through
``ClusterEngine``) and keeps it for the application's lifetime. The cell's actors are
detached, so they outlive this replica's process: restarted by Serve, it adopts them
(see ``running_cell``). Routers never send requests through it; they ask it once for
``CellInfo`` and then call the scheduler directly.
"""

import asyncio
from dataclasses import dataclass
from typing import Any

from ray import serve

from cluster.cluster_engine import ClusterEngine
from cluster.config import config_from_dict
from workers.tokenizer import Tokenizer


@dataclass
class CellInfo:
    """What a router needs of its cell to serve it."""

    cluster_name: str
    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    sampling_defaults: dict[str, float | int]


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class LLMCell:
    """Owns one cell for the application's lifetime: its worker actors and scheduler,
    which outlive this replica's process: restarted by Serve, it adopts them."""

    async def __init__(self, config: dict[str, Any]) -> None:
        self.engine = await asyncio.to_thread(ClusterEngine, config_from_dict(config),
                                              survive_owner=True)

    def describe(self) -> CellInfo:
        e = self.engine
        return CellInfo(e.config.cluster.name, e.tokenizer, e.vocab_size, e.max_model_len,
                        e.sampling_defaults)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
