"""Each linear layer's implementation, chosen by timing the candidates at load.

Which GEMM is fastest depends on the processor and the batch size, not on the vendor:
on an Intel Xeon MKL's ``F.linear`` beat oneDNN's packed weights at batch 1 and lost
from batch 16, on an AMD EPYC oneDNN won at every size (benchmarks/RESULTS.md). So the
CPU ops time every candidate on the layer's own weight, at one row count per
batch-size range, and keep the fastest per range. A choice is made once per distinct
weight (kind, shape) and reused by every layer of that shape, so loading a model pays a
few timings per shape (the default model: five shapes, about 0.2 s, most of it the LM
head), each candidate bounded by a small time budget.

The first process on a machine to time a (kind, shape) publishes its choice in a file;
every later process (the other workers of a cell, a restarted one) takes it from there
rather than timing again. Timings vary with load, and two implementations round fp32
differently, so two workers choosing apart would make a handed-off sequence's greedy
text depend on which worker ran which step. Since the first choice stays, a process times
a shape holding the machine's lock (``ChoiceStore.exclusive``): a cell's workers load at
once, and timing side by side each would slow the other's calls.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

Run = Callable[[torch.Tensor, Any, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class LinearImpl:
    """One way to compute ``x @ W.T + bias``: ``pack`` makes its weight once at load,
    ``run`` reads it (candidates with the same ``pack`` share one packed weight)."""

    name: str
    pack: Callable[[Any], Any]
    run: Run


@dataclass(frozen=True)
class RowRange:
    """Row counts from ``first`` up to the next range's first, timed at ``timed`` rows."""

    first: int
    timed: int


# Decode batches of 1-3, small batches (the w8a16 kernel's up to 16 rows), mid-sized
# decode batches (where W8A8's packed product still streams its weight faster than
# _int_mm), and larger batches and prefill chunks.
ROW_RANGES = (RowRange(1, 1), RowRange(4, 8), RowRange(17, 24), RowRange(33, 128))
# Written before each timed call so that the weight comes from memory, as it does in a
# model whose layers together outgrow the last-level cache (a decode step reads each
# once); timed hot, a small layer's weight would sit in cache and favour the wrong kernel.
EVICT_BYTES = 64 << 20
CHOICES_ENV = "LLM_CLUSTER_LINEAR_CHOICES"   # where the machine's choices live (default_store)


@dataclass(frozen=True)
class LinearChoice:
    """The implementation chosen per row range, with the timings that chose it
    (milliseconds per candidate; empty where there was nothing to choose between)."""

    kind: str
    shape: tuple[int, int]
    ranges: tuple[RowRange, ...]
    names: tuple[str, ...]
    timings_ms: tuple[dict[str, float], ...]

    def describe(self) -> str:
        parts = []
        for i, (r, name, ms) in enumerate(zip(self.ranges, self.names, self.timings_ms)):
            last = f"-{self.ranges[i + 1].first - 1}" if i + 1 < len(self.ranges) else "+"
            timed = ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items())
            parts.append(f"rows {r.first}{last}: {name}" + (f" ({timed} at {r.timed})"
                                                           if timed else ""))
        return f"linear {self.kind} {self.shape[0]}x{self.shape[1]}: " + "; ".join(parts)


@dataclass
class ChosenLinear:
    """A weight packed for the implementations chosen for it; calling it runs the one
    chosen for the call's row count."""

    choice: LinearChoice
    out_features: int
    firsts: tuple[int, ...]
    runs: tuple[tuple[Run, Any], ...]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        run, packed = self.runs[self._range(x)]
        return run(x, packed, bias)

    def packed_for(self, x: torch.Tensor) -> Any:
        """The weight as packed for the implementation that ``x``'s row count runs."""
        return self.runs[self._range(x)][1]

    def _range(self, x: torch.Tensor) -> int:
        return range_index(self.firsts, x.numel() // x.shape[-1])


def range_index(firsts: Sequence[int], rows: int) -> int:
    """The row range that ``rows`` rows fall in, of ranges starting at ``firsts``."""
    return max(0, bisect.bisect_right(firsts, rows) - 1)


class ChoiceStore:
    """Choices shared by the processes of one machine: a file per (kind, shape, row
    ranges, candidates) under ``directory``, keyed also by ``machine`` (the processor,
    torch and our kernels). The first choice published wins; a later one reads it instead."""

    def __init__(self, directory: Path, machine: str) -> None:
        self.directory, self.machine = directory, machine

    def _path(self, kind: str, shape: tuple[int, int], ranges: Sequence[RowRange],
              candidates: Sequence[str]) -> Path:
        key = json.dumps([self.machine, kind, shape, [(r.first, r.timed) for r in ranges],
                          sorted(candidates)])
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def get(self, kind: str, shape: tuple[int, int], ranges: Sequence[RowRange],
            candidates: Sequence[str]) -> tuple[str, ...] | None:
        try:
            names = tuple(json.loads(self._path(kind, shape, ranges, candidates)
                                     .read_text())["names"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        ok = len(names) == len(ranges) and set(names) <= set(candidates)
        return names if ok else None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held while this process times a shape: another process loading at the same
        time waits, then reads the choice, instead of timing beside it. Two processes
        timing the default model's w8a8 layers at once on two cores took ~20 ms a call,
        either candidate, against 0.25-0.7 ms alone, and kept a kernel 1.8x slower for
        the largest layer (benchmarks/RESULTS.md). Released if the process dies."""
        fd = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:   # a read-only cache: time without the lock
            log.warning("linear choices timed without the machine's lock (%s): %s",
                        self.directory, e)
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)

    def publish(self, kind: str, shape: tuple[int, int], ranges: Sequence[RowRange],
                candidates: Sequence[str], names: tuple[str, ...]) -> tuple[str, ...]:
        """Publish ``names`` unless a choice is there already; the names to use."""
        path = self._path(kind, shape, ranges, candidates)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"kind": kind, "shape": shape, "names": names}, f)
            try:
                os.link(tmp, path)   # atomic, and fails if another process got there first
            finally:
                os.unlink(tmp)
        except FileExistsError:
            pass
        except OSError as e:   # a read-only cache: this process keeps its own choice
            log.warning("linear choices not shared (%s): %s", path, e)
            return names
        return self.get(kind, shape, ranges, candidates) or names


def default_store(kernels: str) -> ChoiceStore:
    """The machine's store, ``$LLM_CLUSTER_LINEAR_CHOICES`` or the engine's cache
    directory's ``linear_choice``, for the candidates that the kernels named ``kernels``
    (a digest of their sources) offer. The test suite keeps its own: its processes time
    on a machine its other tests keep busy, and their choices would stay for every later
    run of the engine there."""
    from workers.loading.checkpoint import cache_root

    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo()
                if line.startswith("model name")), "unknown cpu")
    machine = f"{cpu}|{os.cpu_count()}|torch {torch.__version__}|kernels {kernels}"
    directory = os.environ.get(CHOICES_ENV) or cache_root() / "linear_choice"
    return ChoiceStore(Path(directory), machine)


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


class LinearChooser:
    """Times candidates on a weight, per row range, and remembers the choice per (kind,
    shape). ``clock`` is injectable so that a test can give candidates known costs."""

    def __init__(self, ranges: Sequence[RowRange] = ROW_RANGES,
                 clock: Callable[[], float] = time.perf_counter, repeats: int = 3,
                 budget_s: float = 0.02, store: ChoiceStore | None = None,
                 evict_bytes: int = EVICT_BYTES) -> None:
        self.ranges = tuple(ranges)
        self.clock, self.repeats, self.budget_s = clock, repeats, budget_s
        self._evict = torch.empty(evict_bytes // 4)
        self.store = store
        self.choices: dict[tuple[str, tuple[int, int]], LinearChoice] = {}

    def choose(self, weight: Any, kind: str, shape: tuple[int, int],
               candidates: Sequence[LinearImpl]) -> ChosenLinear:
        """``weight`` [out, in] (``shape``) packed for its chosen implementations; the
        first weight of a (kind, shape) is timed, later ones reuse its choice."""
        key = (kind, shape)
        by_name = {c.name: c for c in candidates}
        made: dict[Callable[[Any], Any], Any] = {}   # candidates sharing a pack share its result

        def packed(c: LinearImpl) -> Any:
            if c.pack not in made:
                made[c.pack] = c.pack(weight)
            return made[c.pack]

        choice = self.choices.get(key)
        if choice is None:
            choice = self._stored(kind, shape, list(by_name))
        if choice is None:
            with self.store.exclusive() if self.store else contextlib.nullcontext():
                choice = self._stored(kind, shape, list(by_name)) or self._measured(
                    kind, shape, candidates, {c.name: packed(c) for c in candidates})
        self.choices[key] = choice
        runs = tuple((by_name[n].run, packed(by_name[n])) for n in choice.names)
        return ChosenLinear(choice, shape[0], tuple(r.first for r in self.ranges), runs)

    def _stored(self, kind: str, shape: tuple[int, int],
                candidates: list[str]) -> LinearChoice | None:
        names = (None if self.store is None
                 else self.store.get(kind, shape, self.ranges, candidates))
        if names is None:
            return None
        choice = LinearChoice(kind, shape, self.ranges, names, tuple({} for _ in names))
        log.info("%s (this machine's earlier choice)", choice.describe())
        return choice

    def _measured(self, kind: str, shape: tuple[int, int], candidates: Sequence[LinearImpl],
                  packed: dict[str, Any]) -> LinearChoice:
        """Timed here, then published; another process's choice published first wins."""
        choice = self._measure(kind, shape, candidates, packed)
        if self.store is not None:
            names = self.store.publish(kind, shape, self.ranges,
                                       [c.name for c in candidates], choice.names)
            if names != choice.names:
                choice = LinearChoice(kind, shape, self.ranges, names, tuple({} for _ in names))
        log.info("%s", choice.describe())
        return choice

    def _measure(self, kind: str, shape: tuple[int, int], candidates: Sequence[LinearImpl],
                 packed: dict[str, Any]) -> LinearChoice:
        names, timings = [], []
        for r in self.ranges:
            ms = (self._time(candidates, packed, r.timed, shape[1], warm=not any(timings))
                  if len(candidates) > 1 else {})
            names.append(min(ms, key=ms.__getitem__) if ms else candidates[0].name)
            timings.append(ms)
        return LinearChoice(kind, shape, self.ranges, tuple(names), tuple(timings))

    @torch.inference_mode()
    def _time(self, fit: Sequence[LinearImpl], packed: dict[str, Any], rows: int,
              in_features: int, warm: bool) -> dict[str, float]:
        """Best of up to ``repeats`` calls per candidate in interleaved rounds; a
        candidate stops once its calls spent ``budget_s``. ``warm``: one untimed call
        each first (the first range timed: it brings the weights into memory)."""
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0))
        best = {c.name: float("inf") for c in fit}
        spent = dict.fromkeys(best, 0.0)
        for c in fit if warm else ():
            c.run(x, packed[c.name], None)
        for _ in range(self.repeats):
            for c in fit:
                if spent[c.name] >= self.budget_s:
                    continue
                self._evict.fill_(1.0)
                start = self.clock()
                c.run(x, packed[c.name], None)
                took = self.clock() - start
                spent[c.name] += took
                best[c.name] = min(best[c.name], took)
        return {name: t * 1e3 for name, t in best.items()}
