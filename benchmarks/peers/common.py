"""What every peer shares: its result record, the workload format, the model paths, and
running a peer in its own process.

Each peer runs in a fresh interpreter so that its peak RSS is its own (model, KV cache,
runtime) and not whatever the previous peer or the calling benchmark left resident.

    result = run_isolated("hf_static", prompts, max_tokens, concurrency=16)
    result = run_isolated("engine", prompts, max_tokens, 64,
                          options={"enable_prefix_caching": False})
"""

from __future__ import annotations

import importlib
import json
import resource
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PEERS = ("engine", "hf_static", "hf_continuous", "llama_cpp")
# Peers pin their thread count so they compete on the same cores as the engine.
NUM_THREADS = 2
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class PeerResult:
    """One peer's run of a workload; output_tokens counts what the peer really generated."""

    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float  # generation only: model load and warmup excluded
    peak_rss_bytes: int  # of the peer's whole process, model load included
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # peer-specific figures (JSON-able)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class Workload:
    """Prompts as token ids (no tokenizer involved) and each request's exact output length."""

    prompts: list[list[int]]
    max_tokens: list[int]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.max_tokens):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.max_tokens)} max_tokens")
        if any(not p for p in self.prompts) or any(m < 1 for m in self.max_tokens):
            raise ValueError("every prompt needs at least one token and max_tokens >= 1")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> Workload:
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls([list(map(int, p)) for p in data["prompts"]],
                   [int(m) for m in data["max_tokens"]])


def default_gguf() -> Path:
    """The engine's default model file (SmolLM2-135M-Instruct, Q4_1 GGUF)."""
    from workers.loading import default_model_path

    return Path(default_model_path())


def default_hf_dir() -> Path:
    """The engine's own fp32 HF conversion of the default GGUF (created on first use).

    HF peers load this instead of the GGUF so that they run exactly the weights the
    engine runs, and load in a second rather than re-dequantizing.
    """
    from workers.loading import cache_root
    from workers.loading.gguf_checkpoint import converted_dir

    return converted_dir(default_gguf(), cache_root(), require_tokenizer=False).directory


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peer_available(module_name: str) -> tuple[bool, str]:
    """Whether a peer can run here, and why not; cheap, nothing heavy is imported."""
    return importlib.import_module(f"benchmarks.peers.{module_name}").available()


def run_isolated(module_name: str, prompts: list[list[int]], max_tokens: list[int],
                 concurrency: int | None, timeout_s: float | None = None,
                 options: dict[str, Any] | None = None) -> PeerResult:
    """Run ``benchmarks.peers.<module_name>.run`` in a fresh Python process.

    ``options`` are extra keyword arguments of that ``run`` (JSON-able values).

    The workload goes in and the result comes back as JSON files, so nothing a peer
    prints (progress bars, native library logs) can corrupt the exchange.
    """
    if module_name not in PEERS:
        raise ValueError(f"unknown peer {module_name!r}; peers: {', '.join(PEERS)}")
    with tempfile.TemporaryDirectory(prefix="peer-") as tmp:
        workload_path, result_path = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        Workload(prompts, max_tokens).save(workload_path)
        args = [sys.executable, "-m", "benchmarks.peers.common", module_name, str(workload_path),
                str(result_path), "" if concurrency is None else str(concurrency),
                json.dumps(options or {})]
        proc = subprocess.run(args, cwd=_REPO_ROOT, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        if proc.returncode != 0 or not result_path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            raise RuntimeError(f"peer {module_name} failed (exit {proc.returncode}):\n"
                               + "\n".join(tail))
        return PeerResult(**json.loads(result_path.read_text(encoding="utf-8")))


def _child_main(argv: list[str]) -> None:
    """Entry point of the isolated process: run one peer, write its result as JSON."""
    module_name, workload_path, result_path, concurrency, options = argv
    peer = importlib.import_module(f"benchmarks.peers.{module_name}")
    workload = Workload.load(Path(workload_path))
    result = peer.run(workload.prompts, workload.max_tokens,
                      int(concurrency) if concurrency else None, **json.loads(options))
    Path(result_path).write_text(json.dumps(asdict(result)), encoding="utf-8")


if __name__ == "__main__":
    _child_main(sys.argv[1:])
