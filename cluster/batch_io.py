"""The batch job's files: input rows read as a stream, results kept safe on disk.

Input is JSONL or Parquet, read a piece at a time, so a file of any size costs the
memory of one record batch. Parquet goes through pyarrow's ``iter_batches``. JSONL is
parsed line by line: pyarrow's streaming JSON reader fixes each column's type on the
first block and fails the whole file on a later row of another type (an id given as
a number in one row and a string in another, ``messages`` given as a string), and a
bad row must cost that row only. Results go to part files next to the output
(``<output>.parts/``), each written under a temporary name and renamed, so a killed
job loses at most the rows not yet flushed and a reader never sees half a file. At
the end the output and the parts are merged into a new file that replaces the output
in one rename. A resumed job reads the ids of both and skips those rows.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SAMPLING_COLUMNS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                    "stop", "ignore_eos")
# structured_outputs: {json | regex | choice | grammar | json_object} as vLLM names them
# (an object in JSONL, its JSON text in Parquet)
INPUT_COLUMNS = ("id", "prompt", "messages", "structured_outputs", *SAMPLING_COLUMNS)
FORMATS = (".jsonl", ".json", ".parquet")
_PARQUET_BATCH_ROWS = 1024

log = logging.getLogger(__name__)


@dataclass
class InputRow:
    index: int                # 0-based position among the input's rows
    id: str                   # the ``id`` column as text, else the row number
    fields: dict[str, Any]    # the known columns this row gives
    error: str | None = None  # why the row could not be read


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


# ---- input ---------------------------------------------------------------------------
def input_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"--input {str(path)!r}: unknown format {suffix!r}; expected a "
                         "file ending in .jsonl (one JSON object per line) or .parquet")
    if not path.is_file():
        raise FileNotFoundError(f"--input {str(path)!r} does not exist; pass an existing "
                                ".jsonl or .parquet file")
    return "parquet" if suffix == ".parquet" else "jsonl"


def count_rows(path: Path) -> int:
    """The number of input rows (Parquet: from the footer; JSONL: non-blank lines)."""
    if input_format(path) == "parquet":
        return pq.ParquetFile(path).metadata.num_rows
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def read_rows(path: Path) -> Iterator[InputRow]:
    """Yield the input's rows in order. Columns this command does not read are ignored,
    each named once in a warning (a misspelt ``max_token`` would otherwise pass
    unnoticed)."""
    values = _parquet_values(path) if input_format(path) == "parquet" else _json_values(path)
    for index, value in enumerate(values):
        if isinstance(value, str):
            yield InputRow(index, str(index), {}, value)
            continue
        row_id = value.get("id")
        yield InputRow(index, str(index) if row_id is None else str(row_id),
                       {k: v for k, v in value.items() if k in INPUT_COLUMNS and k != "id"})


def _parquet_values(path: Path) -> Iterator[dict[str, Any]]:
    f = pq.ParquetFile(path)
    names = f.schema_arrow.names
    _check_columns(path, names)
    _warn_unread(names, set())
    for batch in f.iter_batches(batch_size=_PARQUET_BATCH_ROWS,
                                columns=[c for c in names if c in INPUT_COLUMNS]):
        yield from batch.to_pylist()


def _warn_unread(names: Iterable[str], warned: set[str]) -> None:
    """Name each column this command does not read once (``warned``: those named)."""
    for name in sorted(set(names) - set(INPUT_COLUMNS) - warned):
        log.warning("input column %r is not one this command reads (%s); ignored", name,
                    ", ".join(INPUT_COLUMNS))
        warned.add(name)


def _json_values(path: Path) -> Iterator[dict[str, Any] | str]:
    """Each non-blank line's object, or why the line is not one. Each line may have
    keys of its own, so each is checked for unread ones (a Parquet file's columns are
    checked once)."""
    warned: set[str] = set()
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                yield f"line {number} is not valid JSON ({e}); expected one JSON object"
                continue
            if not isinstance(value, dict):
                yield (f"line {number} is a JSON {type(value).__name__}; expected an object "
                       "with 'prompt' or 'messages'")
                continue
            _warn_unread(value.keys(), warned)
            yield value


def _check_columns(path: Path, names: list[str]) -> None:
    if "prompt" not in names and "messages" not in names:
        raise ValueError(f"--input {str(path)!r} has columns {names}; expected a 'prompt' "
                         "(text) or 'messages' (chat) column")


# ---- output --------------------------------------------------------------------------
class OutputStore:
    """The output file and its flushed parts; every file appears by rename only."""

    def __init__(self, output: Path) -> None:
        if output.suffix.lower() != ".parquet":
            raise ValueError(f"--output {str(output)!r}: expected a path ending in .parquet")
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
            _check_schema(path)
            for batch in pq.ParquetFile(path).iter_batches(columns=["id"]):
                done.update(batch.column(0).to_pylist())
        parts = self._part_files()
        self._next_part = int(parts[-1].stem.split("-")[1]) + 1 if parts else 0
        return done

    def write_part(self, rows: list[ResultRow]) -> None:
        """Make ``rows`` durable as one new part file."""
        if not rows:
            return
        self.parts.mkdir(parents=True, exist_ok=True)
        final = self.parts / f"part-{self._next_part:06d}.parquet"
        self._next_part += 1
        table = pa.Table.from_pylist([dict(zip(_NAMES, astuple(r))) for r in rows],
                                     schema=OUTPUT_SCHEMA)
        _write_atomic(final, [table])

    def merge(self) -> int:
        """Replace the output with the output plus every part (each id once); returns
        the number of rows. The parts are removed only after the rename."""
        if self.output.is_file() and not self._part_files():   # nothing new
            shutil.rmtree(self.parts, ignore_errors=True)
            return pq.ParquetFile(self.output).metadata.num_rows
        self.output.parent.mkdir(parents=True, exist_ok=True)
        written: set[str] = set()

        def tables() -> Iterator[pa.Table]:
            for path in self._sources():
                for batch in pq.ParquetFile(path).iter_batches():
                    keep = []
                    for row_id in batch.column("id").to_pylist():
                        keep.append(row_id not in written)
                        written.add(row_id)
                    yield pa.Table.from_batches([batch]).filter(pa.array(keep))

        _write_atomic(self.output, tables(), tmp=self.tmp)
        shutil.rmtree(self.parts, ignore_errors=True)
        return len(written)

    def _part_files(self) -> list[Path]:
        return sorted(self.parts.glob("part-*.parquet")) if self.parts.is_dir() else []

    def _sources(self) -> list[Path]:
        return ([self.output] if self.output.is_file() else []) + self._part_files()


_NAMES = [f.name for f in fields(ResultRow)]


def _check_schema(path: Path) -> None:
    names = pq.ParquetFile(path).schema_arrow.names
    if names != OUTPUT_SCHEMA.names:
        raise ValueError(f"{str(path)!r} exists but is not a batch result (columns {names}, "
                         f"expected {OUTPUT_SCHEMA.names}); pick another --output or move "
                         "the file away")


def _write_atomic(final: Path, tables: Iterable[pa.Table], tmp: Path | None = None) -> None:
    """Write to a temporary name, fsync, rename over ``final``, fsync the folder."""
    tmp = tmp or final.with_name(f".{final.name}.tmp")
    with pq.ParquetWriter(tmp, OUTPUT_SCHEMA) as writer:
        for table in tables:
            writer.write_table(table)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
