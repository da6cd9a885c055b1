"""Fixtures of the KV cache tests."""

from __future__ import annotations

import pytest

from kvcache import block_checksum


@pytest.fixture(params=["native", "numpy"])
def copy_path(request, monkeypatch) -> str:
    """The receiver's verified copy in C (``native_copy``) or its fallback (numpy and the
    ``crc32c`` package, as on a machine without a C compiler)."""
    if request.param == "numpy":
        monkeypatch.setattr(block_checksum, "native_copier", lambda: None)
    elif block_checksum.native_copier() is None:
        pytest.skip("no native copy on this machine (test_native_copy says why)")
    return request.param
