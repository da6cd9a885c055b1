"""The batch job's input: rows of prompts read as a stream (results: ``batch_store``).

Input is JSONL or Parquet, read a piece at a time, so a file of any size costs the
memory of one record batch. Parquet goes through pyarrow's ``iter_batches``. JSONL is
parsed line by line: pyarrow's streaming JSON reader fixes each column's type on the
first block and fails the whole file on a later row of another type (an id given as
a number in one row and a string in another, ``messages`` given as a string), and a
bad row must cost that row only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
