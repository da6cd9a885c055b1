"""The default model with int8 linear layers and int8 KV against HF transformers' fp32
forward, teacher-forced over real English text (benchmarks/quantization_quality.py).

Issue #15's targets: top-1 agreement >= 97% for every configuration, perplexity
increase < 2% (w8a16, int8 KV) and < 5% (w8a8). Agreement of w8a8 falls short of 97%, so
its floor here is what it reaches, below the target, and says so.

The figures of the two configurations that round activations at run time (w8a8's
per-token int8, int8 KV) are one draw of a distribution: a rounding that flips early
changes every later layer's input, so a relative change of 1e-6 in the embeddings (as
another CPU's kernels make) moves them as much as most changes of method tried. Over
eleven such draws of 1025 tokens (benchmarks/RESULTS.md, "The w8a8 quality test's
flake"; ``--draws`` of the benchmark) int8 KV reached 97.9-98.9% / -0.07 to +0.07%, and
w8a8 94.2-95.3% / +0.4-1.2% with symmetric activations, 95.4-96.1% / +0.3-0.6% over five
with asymmetric ones; w8a16 (scales per 64 input columns) stayed at 97.37% /
+0.18-0.19% in every draw. The floors leave room for those spreads; over 513 tokens w8a8
spread from 93.4% to 95.3%, too wide for a floor."""

from __future__ import annotations

import pytest

from benchmarks.quantization_quality import CONFIGS, measure, table

pytestmark = pytest.mark.slow

# label -> (lowest top-1 agreement, highest perplexity increase)
FLOORS = {"fp32": (0.999, 0.001),
          "int8 KV": (0.97, 0.02),       # the target
          "w8a16": (0.97, 0.02),         # the target (group scales)
          "w8a8": (0.945, 0.02)}         # target 0.97 not met: 95.4-96.1% / +0.3-0.6%


def test_quantized_model_against_hf_fp32(default_model_path):
    results = measure({k: CONFIGS[k] for k in FLOORS}, 1024, default_model_path)
    print(table(results))
    for r in results:
        agreement, increase = FLOORS[r.label]
        assert r.agreement >= agreement, r
        assert r.perplexity_increase < increase, r


def test_the_noise_draws_move_a_continuous_model_by_rounding_only(default_model_path):
    """``--draws``: the embeddings' 1e-6 noise really reaches the model, and fp32, which
    rounds nothing at run time, moves by no more than rounding (unlike w8a8, above)."""
    first, noisy = measure({"fp32": CONFIGS["fp32"]}, 256, default_model_path, draws=2)
    assert (first.draw, noisy.draw) == (0, 1)
    assert noisy.perplexity != first.perplexity
    assert abs(noisy.perplexity / first.perplexity - 1) < 1e-4
    assert noisy.agreement >= 0.996


def test_decode_steps_give_the_prefill_chunks_figures(default_model_path):
    """``--decode``: one decode step per token reads the pool through the decode kernel;
    for fp32, which rounds nothing at run time, it must give the prefill chunks' figures
    up to float rounding (a step that missed or repeated a position would not)."""
    chunked, stepped = (measure({"fp32": CONFIGS["fp32"]}, 128, default_model_path,
                                decode=decode)[0] for decode in (False, True))
    assert abs(stepped.perplexity / chunked.perplexity - 1) < 1e-4
    assert stepped.agreement >= 0.99
