"""The engine behind ``LLM`` when the configuration names worker pools: a Ray cluster.

It starts (or joins) a Ray instance, launches the worker actors of every pool with
their resources, and the global scheduler as a named, detached actor (or adopts a
running cell of its name); then it is the cell's first client (``cluster_client``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from cluster import running_cell, scheduler_actor
from cluster.autoscaler import Autoscaler
from cluster.cluster_client import ClusterClient
from cluster.config import EngineConfig, sampling_defaults
from cluster.engine import resolve_max_model_len
from cluster.pools import WorkerPools
from cluster.ray_worker import RayWorkerHandle
from cluster.scheduler_actor import NAMESPACE, scheduler_name
from scheduler.config import CellConfig
from scheduler.worker_handle import WorkerRef
from workers.loading import Checkpoint, load_checkpoint
from workers.worker import WorkerInfo, WorkerSpec

log = logging.getLogger(__name__)

_STALE_GRACE_S = 5.0  # how long a scheduler's workers may take to be noticed dead
_STALE_POLL_S = 0.25


class ClusterEngine(ClusterClient):
    """Launches a cluster (worker actors and the global scheduler) and is its first client.

    ``survive_owner``: the cell outlives this engine's process (its workers are detached,
    as the scheduler always is), and an engine started so adopts a running cell of its
    name (see ``running_cell``) instead of launching another: what Serve's restart of a
    dead ``LLMCell`` replica needs.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None,
                 survive_owner: bool = False) -> None:
        cc = config.cluster
        if not cc.pools:
            raise ValueError("cluster.pools: got none; name at least one worker pool to run "
                             "on Ray, or use the one-process engine")
        self.config = config
        if not ray.is_initialized():
            ray.init(address=cc.address, include_dashboard=False, log_to_driver=True)
        mc = config.model
        # The driver needs the tokenizer and the model's shape; cached weights are mmapped.
        ckpt = checkpoint or load_checkpoint(mc.path, dtype=getattr(torch, mc.dtype),
                                             tokenizer=mc.tokenizer,
                                             chat_template=mc.chat_template)
        self.model_config = ckpt.config
        self.sampling_defaults = sampling_defaults(config)
        spec = WorkerSpec(mc.path, mc.tokenizer, mc.dtype, mc.device, mc.seed, mc.ops,
                          config.cache, config.scheduler.max_model_len, 1, config.long_context,
                          mc.quantization, mc.enforce_eager)
        self.pools = WorkerPools(spec, cc.pools, cc.replace_backoff_s, cc.name, NAMESPACE,
                                 detached=survive_owner)
        self.workers = self.pools.workers   # worker id -> actor, every live one
        running = running_cell.adopt(scheduler_name(cc.name), NAMESPACE, self.pools) \
            if survive_owner else None
        if running is not None:
            scheduler, refs, started = running.scheduler, running.workers, \
                running.started(self.pools)
            self.block_size = running.settings.block_size
            self.max_model_len = running.settings.max_model_len
            self._eos_token_ids = running.settings.eos_token_ids
            self._fingerprint = running.info.fingerprint
        else:
            try:
                started = self.pools.launch_initial()
                refs = self._join_initial(started)
                scheduler = self._start_scheduler(refs)
            except BaseException:
                self.pools.kill_all()
                raise
            ray.get(scheduler.start.remote())
        self.pools.serve(scheduler, started, refs, self._fingerprint, self.block_size,
                         -(-self.max_model_len // self.block_size))
        self.autoscaler: Autoscaler | None = None
        if any(lo < hi for lo, hi in (p.bounds for p in cc.pools)):
            self.autoscaler = Autoscaler(scheduler, self.pools, cc.autoscale)
            self.autoscaler.start()
        super().__init__(scheduler, ckpt.tokenizer, ckpt.config.vocab_size, self.max_model_len,
                         scheduler_name(cc.name))

    def _join_initial(self, started: list[tuple[str, int, Any]]) -> list[WorkerRef]:
        """Wait until the first workers have loaded the model and sized their pools;
        settle the context length on the smallest pool."""
        infos: list[WorkerInfo] = ray.get([a.info.remote() for _, _, a in started])
        fingerprints = {i.fingerprint for i in infos}
        if len(fingerprints) != 1:
            raise RuntimeError(f"workers loaded different models ({sorted(fingerprints)}); "
                               "every worker must see the same checkpoint files")
        sizes = {i.block_size for i in infos}
        if len(sizes) != 1:
            raise RuntimeError(f"workers chose different KV block sizes ({sorted(sizes)}): "
                               "their devices' defaults differ; set cache.block_size")
        bs, lc = sizes.pop(), self.config.long_context
        self.block_size = bs
        self.max_model_len = resolve_max_model_len(
            self.config.scheduler.max_model_len, infos[0].model_max_len,
            min(i.num_blocks for i in infos) * bs,
            min(lc.longest_context(i.host_blocks, bs) for i in infos) if lc.enabled else None)
        self._eos_token_ids = infos[0].eos_token_ids
        self._fingerprint = infos[0].fingerprint
        pools = self.config.cluster.pools
        return [WorkerRef(wid, pools[pool].role, RayWorkerHandle(actor), info.num_blocks,
                          info.host_blocks, info.place)
                for (wid, pool, actor), info in zip(started, infos)]

    def _start_scheduler(self, refs: list[WorkerRef]) -> Any:
        """The global scheduler as a named, detached async actor. One of the same name
        left behind by a killed driver (all its workers dead) is replaced."""
        cc, cfg = self.config.cluster, self.config
        name = scheduler_name(cc.name)
        cell = CellConfig(cfg.scheduler, self.block_size, self.max_model_len,
                          self._eos_token_ids, cfg.cache.enable_prefix_caching,
                          cc.prefill_threshold, cc.max_prefill_queue_tokens, cc.max_waiting,
                          cc.transfer_timeout_s, cfg.long_context,
                          prefix_push=cc.prefix_push)

        def create() -> Any:
            return scheduler_actor.launch(name, NAMESPACE, refs, cell)

        try:
            return create()
        except ValueError as e:
            if not _remove_stale_scheduler(name):
                raise ValueError(f"cluster.name: a scheduler named {name!r} already runs "
                                 "on this Ray instance with live workers; shut it down or "
                                 "pick another cluster.name") from e
        deadline = time.monotonic() + _STALE_GRACE_S
        while True:   # a killed actor's name is freed asynchronously
            try:
                return create()
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(_STALE_POLL_S)

    # ---- shutdown --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the scheduler and the workers (the scheduler is detached: it would
        outlive this process otherwise)."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        self.pools.stop()
        try:
            ray.get(self.scheduler.shutdown.remote(), timeout=10)
        finally:
            ray.kill(self.scheduler)
            self.pools.kill_all()


def _remove_stale_scheduler(name: str) -> bool:
    """Kill the scheduler ``name`` if none of its workers is alive: its driver died
    without shutting it down (the scheduler is detached, its workers are not). Returns
    whether the name is free (or soon will be); False when the scheduler still serves."""
    try:
        old = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return True   # gone meanwhile
    deadline = time.monotonic() + _STALE_GRACE_S
    while True:
        try:
            stats = ray.get(old.stats.remote(), timeout=_STALE_GRACE_S)
        except RayActorError:
            return True
        except GetTimeoutError:
            return False   # busy, not dead: leave it alone
        if not stats.live():
            log.warning("replacing scheduler %s: all its workers are dead (its driver "
                        "exited without shutting it down)", name)
            ray.kill(old)
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_STALE_POLL_S)
