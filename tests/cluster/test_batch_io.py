"""Reading a batch job's input rows, without a cluster."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq

from cluster.batch_io import read_rows


def test_unread_columns_are_named_once_and_the_rest_is_read(tmp_path, caplog):
    rows = [{"id": "a", "prompt": "x", "max_token": 5, "topic": "t", "max_tokens": None},
            {"id": "b", "prompt": "y", "max_token": 6, "topic": None, "max_tokens": 7}]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cluster.batch_io"):
            got = list(read_rows(path))
        assert [(r.id, r.fields.get("prompt"), r.fields.get("max_tokens")) for r in got] == \
            [("a", "x", None), ("b", "y", 7)]
        warned = [m for m in caplog.messages if "is not one this command reads" in m]
        assert [m.split("'")[1] for m in warned] == ["max_token", "topic"], path
