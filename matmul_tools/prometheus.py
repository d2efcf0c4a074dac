"""Reading the Prometheus text exposition of GET /metrics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families


def sample_sums(text: str, names: Iterable[str], labels: Mapping[str, str] | None = None) -> dict[str, float]:
    """The value of each sample named in `names`, summed over its label sets (only those carrying every label of
    `labels`); a name with no such sample is left out."""
    wanted = set(names)
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and all(sample.labels.get(key) == value for key, value in (labels or {}).items()):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums
