"""Peer: llama.cpp (through llama-cpp-python) on the same GGUF file, one request at a time.

The usual way to run a small GGUF model on a CPU. It is optional: llama-cpp-python builds
llama.cpp from source, so it is in no requirements file and the benchmark skips this peer
where ``available()`` says no. llama.cpp computes with the file's quantized weights (Q4_1
for the default model), not the fp32 weights the engine and the HF peers use, so its
tokens need not match theirs.

Decoding is a hand-written greedy loop over ``eval`` and the raw logits, not
``create_completion``: that feeds token ids straight in, never stops at EOS and so
generates exactly ``max_tokens`` tokens, with no sampler or detokenizer in the timing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.peers.common import NUM_THREADS, PeerResult, default_gguf, peak_rss_bytes

if TYPE_CHECKING:
    from llama_cpp import Llama

NAME = "llama_cpp"
MIN_CONTEXT = 2048
PREFILL_BATCH = 512


def available() -> tuple[bool, str]:
    """Whether llama-cpp-python imports (its native library included)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # a missing package, or a library built for another CPU
        return False, (f"llama-cpp-python is not usable ({type(exc).__name__}: {exc}); "
                       f"install it with `pip install llama-cpp-python` (builds llama.cpp)")
    return True, ""


def generate(llm: Llama, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedily generate exactly ``max_tokens`` token ids after ``prompt``."""
    import llama_cpp

    llm.reset()  # the next eval drops the previous request's KV cache
    llm.eval(prompt)
    tokens: list[int] = []
    while True:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                       shape=(llm.n_vocab(),))
        tokens.append(int(np.argmax(logits)))
        if len(tokens) == max_tokens:
            return tokens
        llm.eval(tokens[-1:])


def load(n_ctx: int = MIN_CONTEXT) -> Llama:
    """The default GGUF in llama.cpp, with a context of ``n_ctx`` tokens."""
    from llama_cpp import Llama

    return Llama(model_path=str(default_gguf()), n_ctx=n_ctx, n_threads=NUM_THREADS,
                 n_threads_batch=NUM_THREADS, n_batch=PREFILL_BATCH, logits_all=False,
                 verbose=False)


def run(prompts: list[list[int]], max_tokens: list[int], concurrency: int | None) -> PeerResult:
    """Run the requests sequentially in arrival order; ``concurrency`` is ignored."""
    import llama_cpp

    llm = load(max(MIN_CONTEXT, max(len(p) + m for p, m in zip(prompts, max_tokens))))
    generate(llm, prompts[0][:8], 2)  # warmup: weight pages, compute buffers
    start = time.perf_counter()
    output_tokens = sum(len(generate(llm, p, m)) for p, m in zip(prompts, max_tokens))
    elapsed = time.perf_counter() - start
    ignored = "" if concurrency in (None, 1) else f" (concurrency {concurrency} ignored)"
    return PeerResult(
        name=NAME, num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
        output_tokens=output_tokens, elapsed_s=elapsed, peak_rss_bytes=peak_rss_bytes(),
        notes=f"llama-cpp-python {llama_cpp.__version__}, one request at a time{ignored}, "
              f"{NUM_THREADS} threads, n_batch {PREFILL_BATCH}, the GGUF's quantized weights "
              f"(not fp32), greedy argmax, EOS never stops a request")
