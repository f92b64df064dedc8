"""Prometheus per API key × model on the server (API keys and limits): what the routers' usage
batches added since this server started (counters), and the leases granted and refused.
The label values are key names and model names: operators create the keys, so the label
set is theirs (at most 4,096 keys)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from llmgw.model.usage import UsageRow


class UsageTotals:
    """Per (key, model): requests, errors (status >= 400), prompt and completion tokens."""

    def __init__(self) -> None:
        self.by: dict[tuple[str, str], list[int]] = {}

    def rows(self) -> list[dict[str, object]]:
        """For the status document: per key and model, since this server started."""
        return [{"api_key": k, "model": m, "requests": n, "errors": e, "prompt_tokens": p,
                 "completion_tokens": c} for (k, m), (n, e, p, c) in sorted(self.by.items())]

    def add(self, rows: tuple[UsageRow, ...]) -> None:
        for r in rows:
            t = self.by.setdefault((r.api_key, r.model), [0, 0, 0, 0])
            t[0] += r.requests
            t[1] += r.requests if r.status >= 400 else 0
            t[2] += r.prompt_tokens
            t[3] += r.completion_tokens


def usage_families(totals: UsageTotals | None, granted: int = 0, refused: int = 0) -> Iterator[Metric]:
    labels = ["api_key", "model"]
    requests = CounterMetricFamily("llmgw_server_usage_requests",
                                   "Requests the routers metered, per API key and model", labels=labels)
    errors = CounterMetricFamily("llmgw_server_usage_errors",
                                 "Of those, answered with a status of 400 or more", labels=labels)
    tokens = CounterMetricFamily("llmgw_server_usage_tokens",
                                 "Tokens the engines reported, per API key, model and kind "
                                 "(prompt, completion)", labels=[*labels, "kind"])
    leases = CounterMetricFamily("llmgw_server_leases",
                                 "Lease asks of routers for key limits, by outcome (granted, refused)",
                                 labels=["outcome"])
    if totals is not None:
        for (key, model), (n, e, p, c) in sorted(totals.by.items()):
            requests.add_metric([key, model], n)
            errors.add_metric([key, model], e)
            tokens.add_metric([key, model, "prompt"], p)
            tokens.add_metric([key, model, "completion"], c)
        leases.add_metric(["granted"], granted)
        leases.add_metric(["refused"], refused)
    yield from (requests, errors, tokens, leases)
