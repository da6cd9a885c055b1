"""A router's client whose scheduler was replaced by a relaunched cell's: every request
it submits at once reaches the new scheduler, not only the first that found the old
one gone (the others used to see the handle already swapped and fail with a 503)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.protocol import SamplingParams

_NAME = "reattach-test-scheduler"
_STREAMS = 8


def _recorder_class():
    import ray

    @ray.remote(num_cpus=0)
    class Recorder:
        """Stands in for the scheduler: takes submissions and records their ids."""

        def __init__(self) -> None:
            self.submitted: list[str] = []

        async def submit(self, request_id: str, *_: object) -> None:
            await asyncio.sleep(0.05)   # the calls of concurrent streams overlap
            self.submitted.append(request_id)

        async def get_client_updates(self, client_id: str, poll_s: float) -> dict:
            await asyncio.sleep(poll_s)
            return {}

        def abort(self, request_id: str, reason: str | None = None) -> list:
            return []

        def submitted_ids(self) -> list[str]:
            return sorted(self.submitted)

    return Recorder


def test_concurrent_submissions_after_a_relaunch_all_reach_the_new_scheduler(ray_instance):
    import ray

    from cluster.cluster_client import ClusterClient
    from cluster.scheduler_actor import NAMESPACE

    recorder = _recorder_class()
    old = recorder.options(name=_NAME, namespace=NAMESPACE).remote()
    ray.get(old.submitted_ids.remote())
    ray.kill(old, no_restart=True)
    new = recorder.options(name=_NAME, namespace=NAMESPACE).remote()
    try:
        client = ClusterClient(old, None, vocab_size=100, max_model_len=64, name=_NAME)
        params = SamplingParams(max_tokens=4)

        async def open_all() -> list:
            streams = await asyncio.gather(*(
                client.open_stream([1, 2, 3], params, request_id=f"r{i}")
                for i in range(_STREAMS)))
            for s in streams:
                await s.aclose()
            return streams

        asyncio.run(open_all())
        assert ray.get(new.submitted_ids.remote()) == sorted(f"r{i}" for i in range(_STREAMS))
    finally:
        ray.kill(new, no_restart=True)


def test_a_client_without_a_name_has_nothing_to_reattach_to(ray_instance):
    """The offline engine's client holds its scheduler by handle only: a lost scheduler
    is an error it raises, not one it hides by retrying."""
    import ray
    from ray.exceptions import RayActorError

    from cluster.cluster_client import ClusterClient

    old = _recorder_class().remote()
    ray.get(old.submitted_ids.remote())
    ray.kill(old, no_restart=True)
    client = ClusterClient(old, None, vocab_size=100, max_model_len=64)
    with pytest.raises(RayActorError):
        asyncio.run(client.open_stream([1, 2, 3], SamplingParams(max_tokens=4)))
