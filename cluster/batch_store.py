"""A batch job's results, kept safe on disk: parts flushed as rows finish, merged at the end.

Results go to part files next to the output (``<output>.parts/``), each written under a
temporary name and renamed, so a killed job loses at most the rows not yet flushed and
a reader never sees half a file. At the end the output and the parts are merged into
a new file that replaces the output in one rename, each id once. A resumed job reads
the ids of both and skips those rows. The output's suffix picks its format: a Parquet
table of ``ResultRow`` (a file of prompts), or the JSONL lines of OpenAI's Batch API
output, keyed by ``custom_id`` (a file of requests, ``openai_batch``). A job hands each
finished row to a ``ResultSink``, which counts it (summary, progress bar) and decides
when the pending rows become a part.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

_CHUNK_LINES = 1024


@dataclass
class ResultRow:
    id: str
    row: int                  # the input row number, to restore the input order
    text: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None


OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()), ("row", pa.int64()), ("text", pa.string()),
    ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()), ("error", pa.string()),
])
_NAMES = [f.name for f in fields(ResultRow)]


class ResultFormat(Protocol):
    """How one kind of output file holds results: ``chunks`` yields a file's results a
    piece at a time with their ids (refusing a file that is not one of ours)."""

    suffix: str

    def encode(self, rows: list[Any]) -> Any: ...
    def count(self, path: Path) -> int: ...
    def chunks(self, path: Path) -> Iterator[tuple[list[str], Any]]: ...
    def select(self, chunk: Any, keep: list[bool]) -> Any: ...
    def write(self, path: Path, chunks: Iterable[Any]) -> None: ...


class ParquetRows:
    """``ResultRow``s as a Parquet table; a chunk is a record batch."""

    suffix = ".parquet"

    def encode(self, rows: list[ResultRow]) -> pa.Table:
        return pa.Table.from_pylist([dict(zip(_NAMES, astuple(r))) for r in rows],
                                    schema=OUTPUT_SCHEMA)

    def count(self, path: Path) -> int:
        return pq.ParquetFile(path).metadata.num_rows

    def chunks(self, path: Path) -> Iterator[tuple[list[str], pa.Table]]:
        f = pq.ParquetFile(path)
        if f.schema_arrow.names != OUTPUT_SCHEMA.names:
            raise _foreign(path, f"columns {f.schema_arrow.names}, expected "
                           f"{OUTPUT_SCHEMA.names}")
        for batch in f.iter_batches():
            yield batch.column("id").to_pylist(), pa.Table.from_batches([batch])

    def select(self, chunk: pa.Table, keep: list[bool]) -> pa.Table:
        return chunk.filter(pa.array(keep))

    def write(self, path: Path, chunks: Iterable[pa.Table]) -> None:
        with pq.ParquetWriter(path, OUTPUT_SCHEMA) as writer:
            for table in chunks:
                writer.write_table(table)


class BatchOutputLines:
    """OpenAI Batch API output: one JSON object per line, keyed by ``custom_id``; a
    chunk is a list of encoded lines."""

    suffix = ".jsonl"

    def encode(self, rows: list[dict[str, Any]]) -> list[bytes]:
        return [json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows]

    def count(self, path: Path) -> int:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())

    def chunks(self, path: Path) -> Iterator[tuple[list[str], list[bytes]]]:
        ids: list[str] = []
        lines: list[bytes] = []
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                ids.append(_custom_id(path, number, line))
                lines.append(line)
                if len(lines) == _CHUNK_LINES:
                    yield ids, lines
                    ids, lines = [], []
        if lines:
            yield ids, lines

    def select(self, chunk: list[bytes], keep: list[bool]) -> list[bytes]:
        return [line for line, k in zip(chunk, keep) if k]

    def write(self, path: Path, chunks: Iterable[list[bytes]]) -> None:
        with path.open("wb") as f:
            for lines in chunks:
                f.writelines(lines)


def _custom_id(path: Path, number: int, line: bytes) -> str:
    try:
        value = json.loads(line)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not isinstance(value.get("custom_id"), str):
        raise _foreign(path, f"line {number} is not an object with a custom_id")
    return value["custom_id"]


def _foreign(path: Path, why: str) -> ValueError:
    return ValueError(f"{str(path)!r} exists but is not a batch result ({why}); pick "
                      "another --output or move the file away")


FORMATS: dict[str, ResultFormat] = {f.suffix: f for f in (ParquetRows(), BatchOutputLines())}


class OutputStore:
    """The output file and its flushed parts; every file appears by rename only."""

    def __init__(self, output: Path) -> None:
        fmt = FORMATS.get(output.suffix.lower())
        if fmt is None:
            raise ValueError(f"--output {str(output)!r}: expected a path ending in .parquet "
                             "(results of a file of prompts) or .jsonl (OpenAI Batch API "
                             "output, for a file of requests)")
        self.format = fmt
        self.output = output
        self.parts = output.with_name(output.name + ".parts")
        self.tmp = output.with_name(f".{output.name}.tmp")
        self._next_part = 0

    def done_ids(self) -> set[str]:
        """The ids already written by earlier runs (output and parts); removes the
        temporary files a killed run may have left."""
        self.tmp.unlink(missing_ok=True)
        if self.parts.is_dir():
            for leftover in self.parts.glob(".*.tmp"):
                leftover.unlink()
        done: set[str] = set()
        for path in self._sources():
            for ids, _ in self.format.chunks(path):
                done.update(ids)
        parts = self._part_files()
        self._next_part = int(parts[-1].stem.split("-")[1]) + 1 if parts else 0
        return done

    def write_part(self, rows: list[Any]) -> None:
        """Make ``rows`` durable as one new part file."""
        if not rows:
            return
        self.parts.mkdir(parents=True, exist_ok=True)
        final = self.parts / f"part-{self._next_part:06d}{self.format.suffix}"
        self._next_part += 1
        chunk = self.format.encode(rows)
        _write_atomic(final, lambda path: self.format.write(path, [chunk]))

    def merge(self) -> int:
        """Replace the output with the output plus every part (each id once); returns
        the number of rows. The parts are removed only after the rename."""
        if self.output.is_file() and not self._part_files():   # nothing new
            shutil.rmtree(self.parts, ignore_errors=True)
            return self.format.count(self.output)
        self.output.parent.mkdir(parents=True, exist_ok=True)
        written: set[str] = set()

        def chunks() -> Iterator[Any]:
            for path in self._sources():
                for ids, chunk in self.format.chunks(path):
                    keep = []
                    for row_id in ids:
                        keep.append(row_id not in written)
                        written.add(row_id)
                    yield self.format.select(chunk, keep)

        _write_atomic(self.output, lambda path: self.format.write(path, chunks()),
                      tmp=self.tmp)
        shutil.rmtree(self.parts, ignore_errors=True)
        return len(written)

    def _part_files(self) -> list[Path]:
        if not self.parts.is_dir():
            return []
        return sorted(self.parts.glob(f"part-*{self.format.suffix}"))

    def _sources(self) -> list[Path]:
        return ([self.output] if self.output.is_file() else []) + self._part_files()


def _write_atomic(final: Path, write: Callable[[Path], None], tmp: Path | None = None) -> None:
    """Write to a temporary name, fsync, rename over ``final``, fsync the folder."""
    tmp = tmp or final.with_name(f".{final.name}.tmp")
    write(tmp)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass
class BatchSummary:
    rows: int = 0              # rows in the output at the end
    new: int = 0               # rows this run finished (errors included)
    errors: int = 0
    skipped: int = 0           # already in the output
    duplicates: int = 0        # input rows whose id an earlier row already had
    completion_tokens: int = 0
    seconds: float = 0.0

    def line(self, output: Path) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (f"batch: {self.rows} rows in {output} ({self.new} new, {self.errors} errors, "
                f"{self.skipped} already done, {self.duplicates} duplicate ids skipped); "
                f"{self.completion_tokens} output tokens in {self.seconds:.1f} s "
                f"({rate:.1f} tok/s)")


class ResultSink:
    """Where a job's finished rows go: counted in its summary and progress bar, and
    flushed to a part file every ``flush_rows`` rows or ``flush_s`` seconds."""

    def __init__(self, store: OutputStore, total: int, flush_rows: int, flush_s: float,
                 progress: bool) -> None:
        self.store = store
        self.flush_rows = flush_rows
        self.flush_s = flush_s
        self.summary = BatchSummary()
        self.pending: list[Any] = []
        self.bar = tqdm(total=total, unit="row", disable=not progress, desc="batch",
                        mininterval=1.0)
        self.start = self.last_flush = time.monotonic()

    def skip(self, duplicate: bool = False) -> None:
        """A row not run: already in the output, or (``duplicate``) its id taken."""
        if duplicate:
            self.summary.duplicates += 1
        else:
            self.summary.skipped += 1
        self.bar.update(1)

    def add(self, result: Any, failed: bool, completion_tokens: int) -> None:
        summary = self.summary
        self.pending.append(result)
        summary.new += 1
        summary.errors += failed
        summary.completion_tokens += completion_tokens
        rate = summary.completion_tokens / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} tok/s, {summary.errors} errors", refresh=False)
        self.bar.update(1)
        self.tick()

    def tick(self) -> None:
        """Flush if enough rows are pending, or any have waited long enough."""
        now = time.monotonic()
        if len(self.pending) >= self.flush_rows or \
                (self.pending and now - self.last_flush >= self.flush_s):
            self._flush()
            self.last_flush = now

    def close(self) -> None:
        """Keep what is finished, however the job ended."""
        self._flush()
        self.bar.close()

    def finish(self) -> BatchSummary:
        """After ``close``: merge the parts into the output; the summary."""
        self.summary.seconds = time.monotonic() - self.start
        self.summary.rows = self.store.merge()
        return self.summary

    def _flush(self) -> None:
        self.store.write_part(self.pending)
        self.pending.clear()
