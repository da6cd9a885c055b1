"""A Prometheus scrape as the numbers a check reads: every sample by name and labels,
parsed with prometheus_client's own parser (so exposition details such as escaped label
values, ``+Inf`` buckets or exemplars never trip a hand-made split), and sums of them."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

# (sample name, its labels sorted) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str, types: tuple[str, ...] | None = None) -> Samples:
    """Every sample of a text exposition, or only those of metric families of ``types``
    (``counter``, ``gauge``, ``histogram``...) when given."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            if types is None or family.type in types for s in family.samples}


def scrape(base: str, types: tuple[str, ...] | None = None,
           timeout_s: float = 60.0) -> Samples:
    """``parse`` of the server's ``{base}/metrics``."""
    return parse(httpx.get(f"{base}/metrics", timeout=timeout_s).text, types)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The samples named exactly ``name`` summed, over those carrying every given label
    with the given value (0.0 when none does)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))
