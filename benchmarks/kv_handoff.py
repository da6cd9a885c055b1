"""KV handoff prefill -> decode through each transport vs memcpy vs pickled tensors.

For the default model's KV shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64,
block size 16), one sequence's blocks move from one pool to another, both in shared
segments as a worker's host pool is (block-major: a block of every layer is one run,
``kvcache/kv_tensors``). ``--ids scattered`` (the default) picks each side's
block ids at random from the whole pool, the worst case a long-used pool can come to;
``--ids fresh`` takes them from a fresh ``BlockPool`` on each side, as the engine's
allocator hands them out before its pools have churned (ascending, consecutive ids):

- shm (the one-copy same-node transport), request to acknowledgement: export_shared (the
  sender sends the checksums it stored when the blocks were written) -> import_shared
  (the receiver maps the sender's segment, once, and copies each block into its pool,
  taking its CRC32C in the same pass, in C, on torch's threads), in one process (the
  actor calls that carry the description are not timed). The sender's hashing of the blocks, which
  a worker does in the steps that fill them, is timed apart ("seal");
- object store: export_blocks -> ray.put -> ray.get (same process, zero-copy read) ->
  import_blocks, checksum and all checks included, in parts of at most MAX_PART_BYTES as
  the workers hand them off;
- pickle: gather per-layer tensors -> pickle.dumps -> pickle.loads -> index_copy_ into
  the pool, in the same parts;
- memcpy: one torch copy_ of the same number of bytes between the two pools' memory
  (contiguous), the bandwidth ceiling of any copy on this machine;
- with ``--layer-major-too``, shm again between two layer-major pools (a block in
  ``2 * layers`` slabs, the order before block-major shared pools), on the same ids.

The four paths run in turns, round after round, so load from other work on the machine
falls on all of them alike; each figure is the median of --repeats rounds (more for short
sequences, which are noisier) after one warm-up round. Before that the object store's
memory is written once, as a long-running worker's is: a fresh store pays a page fault
per page on its first use (``--cold-store`` skips this).

With ``--gap``, it measures what a user sees instead: on a Ray cluster of 1 prefill + 1
decode worker (the default model, one node, so the handoff takes shared memory), the time
between the first and the second streamed token of a ``--gap-tokens`` prompt, against the
decode worker's step time for that sequence; the handoff adds the difference. It runs
one cluster with ``cluster.prefix_push`` on (the prompt's finished chunks move while the
rest prefills, so the handoff moves the last chunk) and one with it off.

    python benchmarks/kv_handoff.py [--tokens 512 2048 ... 65536] [--repeats 3] [--threads N]
                                    [--ids scattered|fresh] [--cold-store] [--json]
                                    [--layer-major-too]
    python benchmarks/kv_handoff.py --gap [--gap-tokens 8176] [--repeats 3] [--gap-push on off]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import time
from collections.abc import Callable

import numpy as np
import ray
import torch

from benchmarks.default_shape import BLOCK_SIZE, kv_shape
from kvcache.block_checksum import BlockChecksums
from kvcache.block_pool import BlockPool
from kvcache.kv_tensors import KVShape, allocate_kv_cache
from kvcache.kv_transfer import KVLayoutMeta, export_blocks, import_blocks
from kvcache.kv_transport import MAX_PART_BYTES, part_bounds
from kvcache.native_copy import native_copier
from kvcache.shm_segment import PeerSegments, SharedSegment
from kvcache.shm_transport import export_shared, import_shared, pool_checksums

DTYPES = {"float32": torch.float32, "float16": torch.float16}
STORE_BYTES = 2 << 30
PATHS = ("memcpy", "shm", "object_store", "pickle")


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def touch_object_store(chunk: int = 128 << 20) -> None:
    """Put and free objects until the store's memory has been written once."""
    block = np.ones(chunk, dtype=np.uint8)
    for _ in range(2 * STORE_BYTES // chunk):
        ray.get(ray.put(block))


def object_store(src, dst, src_ids: list[int], dst_ids: list[int], meta: KVLayoutMeta,
                 parts: list[tuple[int, int]], phases: dict[str, list[float]]) -> None:
    spent = dict.fromkeys(phases, 0.0)
    for a, b in parts:
        marks = [time.perf_counter()]
        batch = export_blocks(src, src_ids[a:b], [None] * (b - a), [BLOCK_SIZE] * (b - a), meta)
        marks.append(time.perf_counter())
        ref = ray.put(batch)
        del batch
        marks.append(time.perf_counter())
        received = ray.get(ref)
        marks.append(time.perf_counter())
        import_blocks(received, dst, dst_ids[a:b], meta)
        marks.append(time.perf_counter())
        del received, ref
        for name, t0, t1 in zip(phases, marks, marks[1:]):
            spent[name] += t1 - t0
    for name, t in spent.items():
        phases[name].append(t)


def seal(sums: BlockChecksums, src_ids: list[int], phases: dict[str, list[float]]) -> None:
    """The blocks are written again (their checksums gone) and hashed, as the steps that
    fill them do; not part of the handoff."""
    sums.written(src_ids)
    phases["seal"].append(timed(sums.seal, src_ids))


def shared_memory(src, dst, src_ids: list[int], dst_ids: list[int], meta: KVLayoutMeta,
                  segment: SharedSegment, peers: PeerSegments,
                  sums: tuple[BlockChecksums, BlockChecksums],
                  phases: dict[str, list[float]]) -> None:
    start = time.perf_counter()
    description = export_shared(src, src_ids, [None] * len(src_ids),
                                [BLOCK_SIZE] * len(src_ids), meta, segment.handle, sums[0])
    exported = time.perf_counter()
    import_shared(description, dst, dst_ids, meta, peers, sums[1])
    phases["export"].append(exported - start)
    phases["import"].append(time.perf_counter() - exported)


def pickled(src, dst, src_ids: torch.Tensor, dst_ids: torch.Tensor,
            parts: list[tuple[int, int]]) -> None:
    for a, b in parts:
        payload = pickle.dumps([kv[:, src_ids[a:b]] for kv in src])
        for kv, blocks in zip(dst, pickle.loads(payload), strict=True):
            kv.index_copy_(1, dst_ids[a:b], blocks)


def shared_pool(shape: KVShape, num_blocks: int,
                block_major: bool = True) -> tuple[SharedSegment, list[torch.Tensor]]:
    segment = SharedSegment(num_blocks * shape.bytes_per_block, name="kvpool-bench")
    return segment, allocate_kv_cache(shape, num_blocks, torch.device("cpu"), segment.buffer,
                                      block_major)


def block_ids(pattern: str, pool_blocks: int, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` block ids of one side: ``scattered`` at random over the pool, ``fresh`` as a
    fresh pool's allocator gives them."""
    if pattern == "fresh":
        return torch.tensor(BlockPool(pool_blocks).allocate(n))
    return torch.randperm(pool_blocks, generator=g)[:n]


def run(dtype_name: str, token_counts: list[int], repeats: int,
        ids: str = "scattered", layer_major_too: bool = False) -> list[dict]:
    shape = kv_shape(DTYPES[dtype_name])
    meta = KVLayoutMeta.from_shape(shape, "smollm2-135m-bench")
    pool_blocks = max(token_counts) // BLOCK_SIZE + 64
    segment, src = shared_pool(shape, pool_blocks)
    dst_segment, dst = shared_pool(shape, pool_blocks)
    for kv in src:
        kv.normal_()
    peers = PeerSegments()
    sums = (pool_checksums(src), pool_checksums(dst))
    paths = PATHS + (("shm_layer_major",) if layer_major_too else ())
    if layer_major_too:
        lm_segment, lm_src = shared_pool(shape, pool_blocks, block_major=False)
        _, lm_dst = shared_pool(shape, pool_blocks, block_major=False)
        for a, b in zip(lm_src, src, strict=True):
            a.copy_(b)
        lm_sums = (pool_checksums(lm_src), pool_checksums(lm_dst))
        lm_phases: dict[str, list[float]] = {"seal": [], "export": [], "import": []}
    g = torch.Generator().manual_seed(0)
    rows = []
    for tokens in token_counts:
        n = tokens // BLOCK_SIZE
        reps = max(repeats, 32768 // tokens)
        src_ids = block_ids(ids, pool_blocks, n, g)
        dst_ids = block_ids(ids, pool_blocks, n, g)
        nbytes = n * shape.bytes_per_block
        parts = part_bounds(n, max(1, -(-nbytes // MAX_PART_BYTES)))
        # memcpy: the same bytes, contiguous, between the two pools' memory.
        a = torch.frombuffer(segment.buffer, dtype=torch.uint8, count=nbytes)
        b = torch.frombuffer(dst_segment.buffer, dtype=torch.uint8, count=nbytes)
        phases: dict[str, list[float]] = {"export": [], "put": [], "get": [], "import": []}
        shm_phases: dict[str, list[float]] = {"seal": [], "export": [], "import": []}
        ids_list, dst_list = src_ids.tolist(), dst_ids.tolist()
        times: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(reps + 1):
            times["memcpy"].append(timed(b.copy_, a))
            seal(sums[0], ids_list, shm_phases)
            times["shm"].append(timed(shared_memory, src, dst, ids_list, dst_list, meta,
                                      segment, peers, sums, shm_phases))
            times["object_store"].append(timed(object_store, src, dst, ids_list, dst_list,
                                               meta, parts, phases))
            times["pickle"].append(timed(pickled, src, dst, src_ids, dst_ids, parts))
            if layer_major_too:
                seal(lm_sums[0], ids_list, lm_phases)
                times["shm_layer_major"].append(timed(
                    shared_memory, lm_src, lm_dst, ids_list, dst_list, meta, lm_segment, peers,
                    lm_sums, lm_phases))
        assert all(torch.equal(d[:, dst_ids], s[:, src_ids]) for d, s in zip(dst, src))
        row = {"dtype": dtype_name, "tokens": tokens, "blocks": n, "bytes": nbytes,
               "MB": nbytes / 1e6, "parts": len(parts)}
        for path in paths:
            row[f"{path}_s"] = statistics.median(times[path][1:])
            row[f"{path}_GBps"] = nbytes / row[f"{path}_s"] / 1e9
            row[f"{path}_frac_memcpy"] = row["memcpy_s"] / row[f"{path}_s"]
        row |= {f"object_store_{k}_s": statistics.median(v[1:]) for k, v in phases.items()}
        row |= {f"shm_{k}_s": statistics.median(v[1:]) for k, v in shm_phases.items()}
        rows.append(row)
    return rows


async def token_times(engine, prompt: list[int], sp) -> list[float]:
    """When each streamed token of one request arrived."""
    times: list[float] = []
    async for out in engine.generate_stream(prompt, sp):
        n = len(out.outputs[0].token_ids)
        times.extend([time.perf_counter()] * (n - len(times)))
    return times


def first_token_gap(prompt_tokens: int, repeats: int, prefix_push: bool) -> list[dict]:
    """Per run: first -> second token gap, the decode worker's step time after the
    handoff, and the handoff's own time, bytes and transport from the scheduler's stats
    (with ``prefix_push``, also the bytes pushed while the prompt prefilled)."""
    from cluster.cluster_engine import ClusterEngine
    from cluster.config import config_from_dict
    from scheduler.protocol import SamplingParams

    engine = ClusterEngine(config_from_dict({"cluster": {
        "name": "bench-kv-gap", "prefix_push": prefix_push, "pools": [
            {"role": "prefill", "resources": {"CPU": 1}},
            {"role": "decode", "resources": {"CPU": 1}}]}}))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = []
    try:
        for seed in range(repeats + 1):   # the first run is a warm-up
            rng = np.random.default_rng(seed)
            prompt = rng.integers(100, 10_000, prompt_tokens).tolist()
            before = engine.stats().workers
            times = asyncio.run(token_times(engine, prompt, sp))
            after = engine.stats().workers
            sent = {k: getattr(after[0].kv_sent, k) - getattr(before[0].kv_sent, k)
                    for k in ("count", "seconds", "bytes", "failures", "pushed_bytes",
                              "push_failures")}
            steps = {k: getattr(after[1].step_times, k) - getattr(before[1].step_times, k)
                     for k in ("steps", "execute_s")}
            gaps = np.diff(times)
            runs.append({"tokens": prompt_tokens, "prefix_push": prefix_push,
                         "first_gap_s": float(gaps[0]),
                         "later_gap_s": float(np.median(gaps[1:])),
                         "decode_step_s": steps["execute_s"] / max(steps["steps"], 1),
                         "handoff_s": sent["seconds"], "handoff_MB": sent["bytes"] / 1e6,
                         "handoffs": sent["count"], "failures": sent["failures"],
                         "pushed_MB": sent["pushed_bytes"] / 1e6,
                         "push_failures": sent["push_failures"],
                         "transports": after[0].kv_sent.transports})
    finally:
        engine.shutdown()
    return runs[1:]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines of a table with ``header`` and one line per row of cells."""
    return [f"| {' | '.join(cells)} |" for cells in [header, ["---"] * len(header), *rows]]


def markdown(rows: list[dict]) -> str:
    def path(r: dict, name: str) -> list[str]:
        return [f"{1e3 * r[f'{name}_s']:.1f}", f"{r[f'{name}_GBps']:.2f}",
                f"{r[f'{name}_frac_memcpy']:.0%}"]

    layer_major = "shm_layer_major_s" in rows[0]
    return "\n".join(table(
        ["dtype", "tokens", "MB", "memcpy ms", "GB/s", "shm ms", "GB/s", "of memcpy",
         "export / import ms", "seal ms (in the steps)",
         "object store ms", "GB/s", "of memcpy", "parts", "export / put / get / import ms",
         "pickle ms", "GB/s", "of memcpy"]
        + (["shm layer-major ms", "GB/s", "of memcpy"] if layer_major else []),
        [[r["dtype"], str(r["tokens"]), f"{r['MB']:.1f}", *path(r, "memcpy")[:2],
          *path(r, "shm"), f"{1e3 * r['shm_export_s']:.1f} / {1e3 * r['shm_import_s']:.1f}",
          f"{1e3 * r['shm_seal_s']:.1f}",
          *path(r, "object_store"), str(r["parts"]),
          " / ".join(f"{1e3 * r[f'object_store_{k}_s']:.1f}"
                     for k in ("export", "put", "get", "import")),
          *path(r, "pickle"), *(path(r, "shm_layer_major") if layer_major else [])]
         for r in rows]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+",
                    default=[512, 2048, 8192, 16384, 32768, 65536])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch threads; 1 is steadier on a machine shared with other work")
    ap.add_argument("--ids", choices=("scattered", "fresh"), default="scattered",
                    help="block ids on each side: at random over the pool, or as a fresh "
                         "pool's allocator hands them out")
    ap.add_argument("--cold-store", action="store_true",
                    help="do not write the object store's memory once before measuring")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    ap.add_argument("--layer-major-too", action="store_true",
                    help="also time shm between layer-major pools (two more pools' memory)")
    ap.add_argument("--gap", action="store_true",
                    help="measure the first -> second token gap on 1 prefill + 1 decode")
    ap.add_argument("--gap-tokens", type=int, default=8176,
                    help="its prompt (the default model's window is 8192 tokens)")
    ap.add_argument("--gap-push", nargs="+", choices=("on", "off"), default=["on", "off"],
                    help="cluster.prefix_push settings to measure, one cluster each")
    args = ap.parse_args()
    if args.gap:
        runs = [r for push in args.gap_push for r in
                first_token_gap(args.gap_tokens, args.repeats, push == "on")]
        print(json.dumps(runs, indent=2) if args.json else "\n".join(table(
            ["prompt tokens", "prefix push", "pushed MB", "1st -> 2nd token ms",
             "later gaps ms", "decode step ms", "handoff ms", "MB", "transport",
             "added by the handoff, in decode steps"],
            [[str(r["tokens"]), "on" if r["prefix_push"] else "off", f"{r['pushed_MB']:.1f}",
              f"{1e3 * r['first_gap_s']:.1f}",
              f"{1e3 * r['later_gap_s']:.1f}", f"{1e3 * r['decode_step_s']:.1f}",
              f"{1e3 * r['handoff_s']:.1f}", f"{r['handoff_MB']:.1f}",
              ", ".join(r["transports"]),
              f"{(r['first_gap_s'] - r['later_gap_s']) / r['later_gap_s']:.2f}"]
             for r in runs])))
        return
    torch.set_num_threads(args.threads)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=STORE_BYTES)
    try:
        if not args.cold_store:
            touch_object_store()
        rows = [row for d in args.dtypes
                for row in run(d, args.tokens, args.repeats, args.ids, args.layer_major_too)]
    finally:
        ray.shutdown()
    copy = "native C" if native_copier() is not None else "numpy + crc32c package"
    if args.json:
        print(json.dumps({"torch_threads": args.threads, "cold_store": args.cold_store,
                          "ids": args.ids,
                          "receiver_copy": copy, "rows": rows}, indent=2))
    else:
        print(f"torch threads: {args.threads}, median of >= {args.repeats} rounds, "
              f"object store {'cold' if args.cold_store else 'written once'}, "
              f"block ids {args.ids}, "
              f"receiver's copy: {copy}\n")
        print(markdown(rows))


if __name__ == "__main__":
    main()
