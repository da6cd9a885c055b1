"""The HTTP load benchmark's pure parts on canned inputs: no server is started."""

from __future__ import annotations

import pytest

from benchmarks import http_load as hl
from benchmarks import load_stats as ls

# A streamed chat completion as `transformers serve` sends it: a role chunk, content
# chunks, a last chunk with finish_reason and usage, no [DONE]; with SSE blank lines.
CANNED = [
    'data: {"choices":[{"delta":{"role":"assistant"},"index":0}]}', "",
    'data: {"choices":[{"delta":{"content":"Once"},"index":0}]}', "",
    ": keep-alive comment", "",
    'data: {"choices":[{"delta":{"content":""},"index":0}]}', "",
    'data: {"choices":[{"delta":{"content":" upon"},"index":0}]}', "",
    'data: {"choices":[{"delta":{"content":" a time"},"index":0}]}', "",
    'data: {"choices":[{"delta":{},"index":0,"finish_reason":"length"}],'
    ' "usage":{"completion_tokens":4,"prompt_tokens":38,"total_tokens":42}}', "",
]


def feed(lines: list[str], times: list[float]) -> ls.RequestResult:
    """Replay ``lines`` into a result sent at 0.0, line i received at ``times[i]``."""
    result = ls.RequestResult(sent=0.0)
    for line, now in zip(lines, times):
        event = ls.parse_sse_line(line)
        if event == ls.DONE:
            break
        if isinstance(event, dict):
            result.observe(event, now)
    result.end = times[len(lines) - 1]
    return result


def test_parse_sse_line_kinds():
    assert ls.parse_sse_line("data: [DONE]\n") == ls.DONE
    assert ls.parse_sse_line("data:{\"a\": 1}") == {"a": 1}
    assert ls.parse_sse_line("") is None
    assert ls.parse_sse_line(": comment") is None
    assert ls.parse_sse_line("event: message") is None


def test_canned_stream_times_and_usage():
    times = [0.1 * i for i in range(1, len(CANNED) + 1)]
    r = feed(CANNED, times)
    # Content chunks: lines 2, 8 and 10 (the role chunk, the empty one and the last skip).
    assert r.content_chunks == 3
    assert r.first == pytest.approx(0.3) and r.last == pytest.approx(1.1)
    assert r.usage_tokens == 4 and r.tokens == 4  # the server's count wins over chunks
    assert r.finished
    assert r.ttft == pytest.approx(0.3)
    assert r.tpot == pytest.approx((1.1 - 0.3) / 3)


def test_stream_without_usage_counts_chunks_and_stops_at_done():
    lines = [line for line in CANNED if "usage" not in line] + ["data: [DONE]",
                                                                'data: {"choices":[{"delta":'
                                                                '{"content":"x"}}]}']
    r = feed(lines, [float(i) for i in range(len(lines))])  # line i arrives at i seconds
    # Content at lines 2, 8 and 10; the chunk after [DONE] is never read.
    assert r.usage_tokens is None and r.tokens == 3
    assert r.tpot == pytest.approx((10.0 - 2.0) / 2)


def test_unfinished_request_counts_only_for_throughput():
    cut = ls.RequestResult(sent=0.0, first=1.0, last=2.0, content_chunks=5,
                           error="cut off by the level's time bound")
    ok = ls.RequestResult(sent=0.0, first=0.5, last=2.5, end=2.6, content_chunks=5)
    s = ls.summarize(2, [cut, ok], wall_s=4.0)
    assert (s.sent, s.finished, s.mean_output_tokens) == (2, 1, 5.0)
    assert s.ttft_p50 == s.ttft_p99 == pytest.approx(0.5)
    assert s.tpot_p50 == pytest.approx(0.5)
    # Throughput counts the cut request's tokens too: (5 + 5) / 4 s.
    assert s.tokens_per_s == pytest.approx(2.5) and s.requests_per_s == pytest.approx(0.25)
    assert s.errors == ["cut off by the level's time bound"]


def test_percentile_interpolates_between_ranks():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert ls.percentile(values, 50) == 3.0
    assert ls.percentile(values, 0) == 1.0 and ls.percentile(values, 100) == 5.0
    assert ls.percentile(values, 99) == pytest.approx(4.96)  # rank 3.96: 4 + 0.96 * (5 - 4)
    assert ls.percentile([1.0, 2.0], 50) == 1.5
    assert ls.percentile([7.0], 99) == 7.0
    assert ls.percentile([], 50) is None


def level(clients: int, tokens: int, wall_s: float, ttft: float, tpot: float) -> ls.LevelStats:
    return ls.LevelStats(clients=clients, sent=10, finished=10, output_tokens=tokens,
                         mean_output_tokens=tokens / 10, wall_s=wall_s, ttft_p50=ttft,
                         ttft_p99=2 * ttft, tpot_p50=tpot, tpot_p99=2 * tpot, e2e_p50=1.0)


def test_ratios_and_target():
    project = level(32, 6000, 20.0, 0.2, 0.050)   # 300 tok/s
    peer = level(32, 6000, 75.0, 0.8, 0.100)      # 80 tok/s
    c = ls.compare(project, peer)
    assert c.throughput == pytest.approx(3.75)
    assert c.ttft_p50 == pytest.approx(0.25) and c.ttft_p99 == pytest.approx(0.25)
    assert c.tpot_p50 == pytest.approx(0.5) and c.tpot_p99 == pytest.approx(0.5)
    assert ls.target_met(c) is True
    slower = ls.compare(level(32, 6000, 30.0, 0.2, 0.050), peer)  # 200 tok/s: 2.5x
    assert slower.throughput == pytest.approx(2.5) and ls.target_met(slower) is False
    assert ls.ratio(1.0, None) is None and ls.ratio(None, 2.0) is None


def test_report_pairs_levels_and_states_the_target():
    runs = {ls.PROJECT: {"levels": [level(8, 1000, 10.0, 0.2, 0.05),
                                    level(32, 6000, 20.0, 0.2, 0.05)]},
            ls.PEER: {"levels": [level(32, 6000, 75.0, 0.8, 0.1)]}}
    assert [c.clients for c in ls.comparisons_of(runs)] == [32]
    text = ls.report(runs)
    assert "| 32 | 3.75 | 0.25 | 0.25 | 0.50 | 0.50 |" in text
    assert "throughput 3.75x, p99 TPOT ratio 0.50: met." in text
    failed = ls.report({ls.PROJECT: runs[ls.PROJECT], ls.PEER: {"error": "no serve"}})
    assert "transformers did not run: no serve" in failed and "Target" not in failed


def test_prompts_are_fixed_by_the_seed_and_distinct():
    a = hl.make_prompts(64, seed=3)
    assert a == hl.make_prompts(64, seed=3) and len(set(a)) == 64
    assert a != hl.make_prompts(64, seed=4)


def test_peer_kv_blocks_match_the_cluster_worker_pool():
    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
               "num_hidden_layers": 30}
    # One block: K and V, fp32, 30 layers, 256 tokens, 3 KV heads of 64 = 11,796,480 bytes.
    assert hl.peer_kv_blocks(smollm2) == (2 << 30) // 11_796_480 == 182
    assert hl.peer_kv_blocks({**smollm2, "head_dim": 128}) == 91


@pytest.mark.parametrize("name", ["offline", "http"])
def test_the_cli_hands_its_arguments_to_the_benchmark(name, capsys):
    from cluster.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: python -m cluster bench {name}" in capsys.readouterr().out
