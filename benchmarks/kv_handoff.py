"""KV handoff prefill -> decode: Arrow KV batch through the Ray object store vs memcpy vs pickle.

For the default model's KV shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64,
block size 16), one sequence's blocks (scattered block ids, as in a used pool) go:

- arrow+ray: export_blocks -> ray.put -> ray.get (same process, zero-copy read) ->
  import_blocks, checksum and all checks included;
- pickle: gather per-layer tensors -> pickle.dumps -> pickle.loads -> index_copy_ into
  the pool;
- memcpy: one torch copy_ of the same number of bytes between two preallocated
  contiguous tensors, the bandwidth ceiling of any copy on this machine;
- the floor: each copy the Arrow path cannot avoid, timed alone on the same blocks --
  the gather into a contiguous buffer, the object store's copy (``ray.put`` of that
  buffer) and the scatter into the pool -- and the payload checksum, which the receiver
  must compute before its first write into the pool (DESIGN.md; the sender's could in
  principle ride along with its gather, so it is not counted). Their sum bounds what the
  contract can reach with these copy routines (faster ones would still leave three copies
  and a read); "floor of memcpy" is memcpy's time over it.

The Arrow path copies the payload three times (gather into a reused buffer, into the
object store, scatter into the pool) and reads it twice (the sender's and the receiver's
checksum, each about half a copy), about four memcpys' worth, so about a quarter of
memcpy bandwidth is its ceiling here; pickle passes over it about five times (gather,
dumps, loads with a fresh buffer, scatter) with no integrity check.
The three paths run in turns, round after round, so load from other work on the machine
falls on all of them alike; each figure is the median of --repeats rounds (more for short
sequences, which are noisier) after one warm-up round. Before that the object store's
memory is written once, as a long-running worker's is: a fresh store pays a page fault
per page on its first use (``--cold-store`` skips this).

    python benchmarks/kv_handoff.py [--tokens 512 2048 8192 16384] [--repeats 3] [--threads N]
                                    [--cold-store] [--json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from collections.abc import Callable

import numpy as np
import ray
import torch

from kvcache.kv_tensors import KVShape, allocate_kv_cache
from kvcache.kv_transfer import (
    KVLayoutMeta,
    _checksum,
    _pool_slabs,
    _slab_ids,
    export_blocks,
    import_blocks,
)

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
DTYPES = {"float32": torch.float32, "float16": torch.float16}
STORE_BYTES = 3 << 30


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def touch_object_store(chunk: int = 128 << 20) -> None:
    """Put and free objects until the store's memory has been written once."""
    block = np.ones(chunk, dtype=np.uint8)
    for _ in range(2 * STORE_BYTES // chunk):
        ray.get(ray.put(block))


def arrow_ray(src, dst, src_ids, dst_ids, meta, phases: dict[str, list[float]]) -> None:
    marks = [time.perf_counter()]
    batch = export_blocks(src, src_ids, [None] * len(src_ids), [BLOCK_SIZE] * len(src_ids),
                          meta)
    marks.append(time.perf_counter())
    ref = ray.put(batch)
    del batch
    marks.append(time.perf_counter())
    received = ray.get(ref)
    marks.append(time.perf_counter())
    import_blocks(received, dst, dst_ids, meta)
    marks.append(time.perf_counter())
    for name, a, b in zip(("export", "put", "get", "import"), marks, marks[1:]):
        phases[name].append(b - a)


FLOOR_PARTS = ("gather", "put", "checksum", "scatter")


def floor_parts(src, dst, src_ids: torch.Tensor, dst_ids: torch.Tensor, rows: torch.Tensor,
                parts: dict[str, list[float]]) -> None:
    """Time the gather (into ``rows``, written before, as export's reused buffer is), the
    store's copy, the scatter and one checksum, each alone."""
    src_slabs, dst_slabs = _pool_slabs(src), _pool_slabs(dst)
    rows = rows.view(src_slabs.dtype).view(-1, src_slabs.shape[1])
    gather_ids, scatter_ids = _slab_ids(src_ids, src), _slab_ids(dst_ids, dst)
    parts["gather"].append(timed(lambda: torch.index_select(src_slabs, 0, gather_ids,
                                                            out=rows)))
    payload = rows.view(torch.uint8).numpy().reshape(-1)
    start = time.perf_counter()
    ref = ray.put(payload)
    parts["put"].append(time.perf_counter() - start)
    del ref
    n = len(src_ids)
    parts["checksum"].append(timed(_checksum, payload, np.full(n, BLOCK_SIZE, np.int32),
                                   [None] * n))
    parts["scatter"].append(timed(dst_slabs.index_copy_, 0, scatter_ids, rows))


def pickled(src, dst, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    payload = pickle.dumps([kv.index_select(1, src_ids) for kv in src])
    for kv, blocks in zip(dst, pickle.loads(payload), strict=True):
        kv.index_copy_(1, dst_ids, blocks)


def run(dtype_name: str, token_counts: list[int], repeats: int) -> list[dict]:
    shape = KVShape(LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPES[dtype_name])
    meta = KVLayoutMeta.from_shape(shape, "smollm2-135m-bench")
    pool_blocks = max(token_counts) // BLOCK_SIZE + 64
    src = allocate_kv_cache(shape, pool_blocks, torch.device("cpu"))
    dst = allocate_kv_cache(shape, pool_blocks, torch.device("cpu"))
    for kv in src:
        kv.normal_()
    g = torch.Generator().manual_seed(0)
    rows = []
    for tokens in token_counts:
        n = tokens // BLOCK_SIZE
        reps = max(repeats, 8192 // tokens)
        src_ids = torch.randperm(pool_blocks, generator=g)[:n]
        dst_ids = torch.randperm(pool_blocks, generator=g)[:n]
        nbytes = n * shape.bytes_per_block
        a = torch.empty(nbytes // shape.dtype.itemsize, dtype=shape.dtype).normal_()
        b = torch.empty_like(a)
        gathered = torch.zeros_like(a)
        phases: dict[str, list[float]] = {"export": [], "put": [], "get": [], "import": []}
        ids_list, dst_list = src_ids.tolist(), dst_ids.tolist()
        parts: dict[str, list[float]] = {k: [] for k in FLOOR_PARTS}
        times: dict[str, list[float]] = {"memcpy": [], "arrow_ray": [], "pickle": []}
        for _ in range(reps + 1):
            times["memcpy"].append(timed(b.copy_, a))
            times["arrow_ray"].append(timed(arrow_ray, src, dst, ids_list, dst_list, meta,
                                            phases))
            times["pickle"].append(timed(pickled, src, dst, src_ids, dst_ids))
            floor_parts(src, dst, src_ids, dst_ids, gathered, parts)
        del a, b, gathered
        memcpy_s, arrow_s, pickle_s = (statistics.median(times[k][1:]) for k in times)
        assert all(torch.equal(d[:, dst_ids], s[:, src_ids]) for d, s in zip(dst, src))
        row = {"dtype": dtype_name, "tokens": tokens, "blocks": n, "bytes": nbytes,
               "MB": nbytes / 1e6,
               "memcpy_s": memcpy_s, "arrow_ray_s": arrow_s, "pickle_s": pickle_s}
        row |= {f"arrow_{k}_s": statistics.median(v[1:]) for k, v in phases.items()}
        row |= {f"floor_{k}_s": statistics.median(v[1:]) for k, v in parts.items()}
        copies_s = sum(row[f"floor_{k}_s"] for k in ("gather", "put", "scatter"))
        row["floor_s"] = copies_s + row["floor_checksum_s"]
        row["copies_frac_memcpy"] = memcpy_s / copies_s
        row["floor_frac_memcpy"] = memcpy_s / row["floor_s"]
        for path in ("memcpy", "arrow_ray", "pickle"):
            row[f"{path}_GBps"] = nbytes / row[f"{path}_s"] / 1e9
        row["arrow_ray_frac_memcpy"] = row["arrow_ray_GBps"] / row["memcpy_GBps"]
        row["pickle_frac_memcpy"] = row["pickle_GBps"] / row["memcpy_GBps"]
        rows.append(row)
    return rows


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines of a table with ``header`` and one line per row of cells."""
    return [f"| {' | '.join(cells)} |" for cells in [header, ["---"] * len(header), *rows]]


def markdown(rows: list[dict]) -> str:
    def ms(r: dict, prefix: str, keys: tuple[str, ...]) -> list[str]:
        return [f"{1e3 * r[f'{prefix}_{k}_s']:.1f}" for k in keys]

    handoff = table(
        ["dtype", "tokens", "MB", "memcpy GB/s", "arrow+ray s", "GB/s", "of memcpy",
         "export / put / get / import ms", "pickle s", "GB/s", "of memcpy"],
        [[r["dtype"], str(r["tokens"]), f"{r['MB']:.1f}", f"{r['memcpy_GBps']:.2f}",
          f"{r['arrow_ray_s']:.3f}", f"{r['arrow_ray_GBps']:.2f}",
          f"{r['arrow_ray_frac_memcpy']:.0%}",
          " / ".join(ms(r, "arrow", ("export", "put", "get", "import"))),
          f"{r['pickle_s']:.3f}", f"{r['pickle_GBps']:.2f}", f"{r['pickle_frac_memcpy']:.0%}"]
         for r in rows])
    floor = table(
        ["dtype", "tokens", "memcpy", "gather", "put", "scatter", "checksum",
         "copies alone, of memcpy", "floor (copies + 1 checksum), of memcpy",
         "arrow+ray, of memcpy"],
        [[r["dtype"], str(r["tokens"]), f"{1e3 * r['memcpy_s']:.1f}",
          *ms(r, "floor", ("gather", "put", "scatter", "checksum")),
          f"{r['copies_frac_memcpy']:.0%}", f"{r['floor_frac_memcpy']:.0%}",
          f"{r['arrow_ray_frac_memcpy']:.0%}"]
         for r in rows])
    return "\n".join([*handoff, "", "The floor: each unavoidable part alone (ms), and what "
                       "they allow:", "", *floor])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch threads; 1 is steadier on a machine shared with other work")
    ap.add_argument("--cold-store", action="store_true",
                    help="do not write the object store's memory once before measuring")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=STORE_BYTES)
    try:
        if not args.cold_store:
            touch_object_store()
        rows = [row for d in args.dtypes for row in run(d, args.tokens, args.repeats)]
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps({"torch_threads": args.threads, "cold_store": args.cold_store,
                          "rows": rows}, indent=2))
    else:
        print(f"torch threads: {args.threads}, median of >= {args.repeats} rounds, "
              f"object store {'cold' if args.cold_store else 'written once'}\n")
        print(markdown(rows))


if __name__ == "__main__":
    main()
