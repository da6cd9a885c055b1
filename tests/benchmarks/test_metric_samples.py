"""The scrape helper that tests and ``bench chaos`` read /metrics with."""

from __future__ import annotations

from benchmarks.metric_samples import parse, total

TEXT = """\
# HELP llm_cluster_errors_total Requests refused or failed.
# TYPE llm_cluster_errors_total counter
llm_cluster_errors_total{kind="overloaded",model_name="m"} 3.0
llm_cluster_errors_total{kind="internal_error",model_name="m"} 1.0
llm_cluster_errors_total{kind="internal_error",model_name="other \\"m\\""} 2.0
# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 4.0
# HELP vllm:num_requests_running_extra A name that starts like the one above.
# TYPE vllm:num_requests_running_extra gauge
vllm:num_requests_running_extra{model_name="m"} 100.0
"""


def test_samples_are_keyed_by_name_and_sorted_labels():
    s = parse(TEXT)
    assert s[("llm_cluster_errors_total", (("kind", "overloaded"), ("model_name", "m")))] == 3
    assert s[("llm_cluster_errors_total",
              (("kind", "internal_error"), ("model_name", 'other "m"')))] == 2
    assert set(parse(TEXT, ("gauge",))) == {
        ("vllm:num_requests_running", (("model_name", "m"),)),
        ("vllm:num_requests_running_extra", (("model_name", "m"),))}


def test_totals_match_the_exact_name_and_every_given_label():
    s = parse(TEXT)
    assert total(s, "llm_cluster_errors_total") == 6
    assert total(s, "llm_cluster_errors_total", kind="internal_error") == 3
    assert total(s, "llm_cluster_errors_total", kind="internal_error", model_name="m") == 1
    assert total(s, "vllm:num_requests_running") == 4     # not the _extra family
    assert total(s, "llm_cluster_errors_total", kind="nope") == 0
