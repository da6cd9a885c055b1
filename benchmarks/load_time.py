"""Load time of the default model: this engine (cold cache, warm cache) vs HF transformers.

Each measurement runs in a fresh process, timed around the load call only (imports
excluded), so no run profits from another's page cache of Python modules; the GGUF
file itself is in the OS page cache for all of them after the first.

    python benchmarks/load_time.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

OURS = """
import json, sys, time, torch
from workers.loading import load_checkpoint
t = time.perf_counter()
ck = load_checkpoint(None, dtype=torch.float32)
print(json.dumps({"s": time.perf_counter() - t}))
"""

HF = """
import json, time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from workers.loading import default_model_path
p = Path(default_model_path())
t = time.perf_counter()
AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
print(json.dumps({"s": time.perf_counter() - t}))
"""


def timed(code: str, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cold, warm, hf = [], [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            env["LLM_CLUSTER_CACHE"] = cache
            cold.append(timed(OURS, env))
            warm.append(timed(OURS, env))
        hf.append(timed(HF, env))
    med = {k: statistics.median(v) for k, v in
           {"ours_first_load_s": cold, "ours_cached_load_s": warm, "hf_transformers_s": hf}.items()}
    med["hf_over_ours_first"] = med["hf_transformers_s"] / med["ours_first_load_s"]
    med["hf_over_ours_cached"] = med["hf_transformers_s"] / med["ours_cached_load_s"]
    print(json.dumps({k: round(v, 3) for k, v in med.items()}, indent=2))


if __name__ == "__main__":
    main()
