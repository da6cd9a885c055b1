"""What the project builds or converts once per machine: where it is kept, and how a
build is published so that processes building the same thing at once never race."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "LLM_CLUSTER_CACHE"


def cache_root() -> Path:
    """``$LLM_CLUSTER_CACHE`` or ~/.cache/llm-cluster (converted GGUF files, kernels)."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/llm-cluster").expanduser()


def publish(target: Path, build: Callable[[Path], Path]) -> None:
    """Run ``build`` in a fresh directory beside ``target`` and rename the file it returns
    to ``target`` whole: builders at once each build their own copy and the last rename
    wins, a loader sees all of a file or none, and a killed build leaves no ``target``
    (nor a lock that would stall the next one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{target.stem}.", dir=target.parent))
    try:
        os.replace(build(scratch), target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
