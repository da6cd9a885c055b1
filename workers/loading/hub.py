"""Model names of the form ``org/name`` (as vLLM takes them), found in the local Hugging
Face cache with ``huggingface_hub``, offline: nothing is fetched at run time, so a
model the cache lacks is an error that says how to fetch it.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def is_hub_id(model: str) -> bool:
    """``org/name`` that is not a local path: a Hugging Face model id."""
    return bool(_REPO_ID.match(model)) and not Path(model).expanduser().exists()


def resolve_hub_model(model: str) -> Path:
    """The cached snapshot directory of the model id ``model`` (its ``main`` revision)."""
    try:
        return Path(snapshot_download(model, local_files_only=True))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {model!r} is not a local path and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); models are never downloaded at run time: fetch it "
            f"first with `hf download {model}` (or point HF_HUB_CACHE at a cache holding "
            "it), or pass a checkpoint directory or .gguf file") from None
