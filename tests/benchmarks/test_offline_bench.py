"""The offline benchmark's pure parts: workloads, roofline interpolation, step split and
report, on hand-made inputs (no model is loaded)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import report
from benchmarks.peers.engine import step_split
from benchmarks.roofline import interpolate, measure_grid, size_grid
from benchmarks.workloads import FIRST_ID, WORKLOAD_A, WORKLOAD_B, generate, sweep_size

VOCAB = 49152


def test_workload_a_lengths_and_ids():
    w = generate(WORKLOAD_A, 256, seed=0, vocab_size=VOCAB)
    assert len(w.prompts) == len(w.max_tokens) == 256
    lengths = [len(p) for p in w.prompts]
    assert min(lengths) >= 32 and max(lengths) <= 512
    assert min(w.max_tokens) >= 16 and max(w.max_tokens) <= 256
    # Uniform over the range: the means sit near its middle.
    assert abs(sum(lengths) / 256 - 272) < 30 and abs(sum(w.max_tokens) / 256 - 136) < 15
    assert all(FIRST_ID <= t < VOCAB for p in w.prompts for t in p)


def test_workload_b_shares_exactly_the_prefix():
    w = generate(WORKLOAD_B, 64, seed=1, vocab_size=VOCAB)
    prefix = w.prompts[0][:400]
    assert all(p[:400] == prefix for p in w.prompts)
    assert all(16 <= len(p) - 400 <= 64 for p in w.prompts)
    assert len({tuple(p[400:]) for p in w.prompts}) == 64  # distinct suffixes
    assert set(w.max_tokens) == {64}


def test_seed_reproduces_and_smaller_n_is_a_prefix():
    big = generate(WORKLOAD_A, 32, seed=7, vocab_size=VOCAB)
    assert generate(WORKLOAD_A, 32, seed=7, vocab_size=VOCAB) == big
    small = generate(WORKLOAD_A, 8, seed=7, vocab_size=VOCAB)
    assert small.prompts == big.prompts[:8] and small.max_tokens == big.max_tokens[:8]
    assert generate(WORKLOAD_A, 32, seed=8, vocab_size=VOCAB) != big
    assert [sweep_size(c) for c in (1, 4, 16, 64, 128)] == [16, 16, 32, 128, 256]


def test_roofline_grid_and_interpolation():
    assert size_grid(0) == []
    assert size_grid(1) == [1]
    assert size_grid(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    grid = [(0, 0.0), (1, 1.0), (2, 1.5), (4, 2.0), (10, 5.0)]
    assert interpolate(grid, 3) == pytest.approx(1.75)
    assert interpolate(grid, 7) == pytest.approx(3.5)
    assert interpolate(grid, 10) == 5.0
    with pytest.raises(ValueError, match="outside"):
        interpolate(grid, 11)
    calls = []

    def timer(rows: int) -> float:  # a fake clock: the third call at each size is slow
        calls.append(rows)
        return rows * (10.0 if len(calls) % 4 == 0 else 1.0)

    # One untimed warmup and three timed calls per size; the median drops the outlier.
    assert measure_grid(timer, 3, repeats=3) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert calls == [1] * 4 + [2] * 4 + [3] * 4


def _record(num_seqs: int, schedule: float, prepare: float) -> SimpleNamespace:
    return SimpleNamespace(num_seqs=num_seqs, schedule_s=schedule, runner_s=0.8,
                           prepare_s=prepare, forward_s=0.6, sample_s=0.1, message_s=0.05,
                           update_s=0.05 - schedule)


def test_step_split_fractions():
    split = step_split([_record(64, 0.02, 0.03), _record(64, 0.02, 0.03)])
    assert split["steps"] == 2 and split["step_s"] == pytest.approx(1.8)
    assert split["forward_frac"] == pytest.approx(1.2 / 1.8)
    assert split["runner_other_s"] == pytest.approx(2 * (0.8 - 0.03 - 0.6 - 0.1))
    assert sum(v for k, v in split.items() if k.endswith("_frac")) == pytest.approx(1.0)
    assert step_split([])["steps"] == 0


def _entry(label: str, tokens: int, seconds: float, **extra) -> dict:
    return {"result": {"name": label, "num_requests": 10, "prompt_tokens": 1000,
                       "output_tokens": tokens, "elapsed_s": seconds,
                       "peak_rss_bytes": 1 << 30, "notes": f"{label} notes", "extra": extra}}


def test_report_checks_and_markdown():
    split = step_split([_record(64, 0.02, 0.03)])
    results = {
        "meta": {"date": "2026-11-23", "command": "python -m cluster bench offline",
                 "machine": "test CPU", "workload_a": "A desc", "workload_b": "B desc",
                 "sweep": "sweep desc"},
        "workload_a": {
            "engine_no_prefix_cache": _entry("e", 1000, 10.0, roofline_fraction=0.7,
                                             split=split, split_at_64=split),
            "hf_static": _entry("h", 1000, 40.0),
            "hf_continuous": {"error": "boom\ntraceback"},
            "llama_cpp": {"skipped": "llama-cpp-python is not usable"},
        },
        "workload_b": {"engine": _entry("e", 600, 2.0, prefix_hit_rate=0.8),
                       "engine_no_prefix_cache": _entry("e", 600, 5.0)},
        "batch1": {"engine_s": 0.05, "hf_static_s": 0.04},
        "memory": {"vs_contiguous_workload": 5.0, "kv_utilisation_at_peak": 0.9,
                   "lines": ["peak 300 sequences"]},
        "sweep": {"engine_no_prefix_cache": {"1": _entry("e", 100, 10.0),
                                             "4": _entry("e", 400, 10.0)},
                  "llama_cpp": {"sequential": _entry("l", 50, 10.0)}},
    }
    got = {c.name: c.passed for c in report.checks(results)}
    assert list(got.values()) == [True, None, None, True, True, False, False, True, False]
    text = report.markdown(results)
    assert "| hf_static | 10 | 1,000 | 40.0 | 25.0 | 0.250 | 4.00 | 1.00 |" in text
    assert "| hf_continuous | failed: boom |" in text
    assert "| llama_cpp | llama-cpp-python is not usable |" in text
    assert "| engine_no_prefix_cache | 10.0 | 40.0 |" in text  # the sweep's row
    assert "| llama_cpp | 5.0 | 5.0 |" in text
    assert "| B: prefix caching on ÷ off | 2.50x | ≥ 2.00x | pass |" in text
    assert "| scheduling + input preparation at 56–72 running | 5.6% | < 5.0% | **FAIL** |" \
        in text
    assert "prefix-cache hit rate: 80.0%" in text and "- peak 300 sequences" in text


def test_memory_figure_counts_contiguous_slabs_in_the_same_bytes():
    """A 2,000-byte budget of fp16 KV (2 bytes a token here) holds 1,000 paged slots; a
    contiguous fp32 cache (4 bytes a token) of 100-token slabs holds 5 sequences in those
    bytes, a contiguous fp16 one 10, so a peak of 25 running is 5x and 2.5x."""
    from benchmarks.offline import memory_figure
    from benchmarks.peers.common import Workload

    extra = {"kv_pool_tokens": 1000, "max_model_len": 500, "kv_bytes_per_token": 2,
             "model_dtype_kv_bytes_per_token": 4, "kv_dtype": "float16", "block_size": 16,
             "peak_running": 25, "kv_utilisation_at_peak": 0.97, "max_num_seqs": 256,
             "preemptions": 0}
    workload = Workload([[1] * 60, [1] * 30], [20, 10])  # longest request: 80 tokens
    m = memory_figure({"result": {"extra": extra}}, workload, max_model_len=100)
    assert m["contiguous_seqs_workload"] == 5 and m["vs_contiguous_workload"] == 5.0
    assert m["contiguous_seqs_longest"] == 6  # 2000 // (80 * 4)
    assert m["contiguous_seqs_served"] == 1 and m["vs_contiguous_served"] == 25.0
    assert m["contiguous_seqs_same_dtype"] == 10 and m["vs_contiguous_same_dtype"] == 2.5
    assert memory_figure({"error": "x"}, workload, 100) == {}
    assert WORKLOAD_A.max_model_len == 768 and WORKLOAD_B.max_model_len == 528


def test_hf_continuous_cache_holds_the_largest_requests_within_the_budget():
    from benchmarks.peers.hf_continuous import PAGE_SIZE, _num_blocks

    prompts, max_tokens = [[1] * 100, [1] * 10, [1] * 200], [28, 10, 56]  # 2, 1, 4 pages
    assert _num_blocks(prompts, max_tokens, slots=2, bytes_per_token=4) == 4 + 2 + 1
    # 2 GiB of pages at 2**24 bytes a token hold 2**31 // (64 * 2**24) = 2 pages.
    assert PAGE_SIZE == 64
    assert _num_blocks(prompts, max_tokens, slots=3, bytes_per_token=1 << 24) == 2
