"""conf/grafana/llmgw.json names only metrics that some daemon exports.

The exported names come from the daemons' own registries (server, agent, router), built
as the daemons build them; the dashboard's names from every PromQL expression in it, with
strings, label matchers, ranges, grouping clauses and PromQL's own words taken out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from llmgw.agent.gpus.usage import GpuSampler
from llmgw.agent.metrics import AgentMetrics
from llmgw.model.inventory import Inventory
from llmgw.router.metrics import RouterMetrics
from llmgw.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "conf" / "grafana" / "llmgw.json"

PROMQL_WORDS = {
    # aggregations and their clauses
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset",
    # functions used in dashboards
    "rate", "irate", "increase", "delta", "idelta", "histogram_quantile", "abs", "clamp_min",
    "clamp_max", "label_replace", "vector", "scalar", "time", "absent", "changes", "resets",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "deriv", "round",
}


def exported(registry: CollectorRegistry) -> set[str]:
    """Every sample name a scrape of `registry` can carry."""
    names: set[str] = set()
    for fam in registry.collect():
        suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_count", "_sum", "_created"],
                    "summary": ["_count", "_sum", "_created"]}.get(fam.type, [""])
        names.update(fam.name + s for s in suffixes)
        names.update(s.name for s in fam.samples)
    return names


def every_export() -> set[str]:
    agent = AgentMetrics("n1", lambda: (), lambda: (0, 0), Inventory, GpuSampler(None))
    return exported(ServerMetrics().registry) | exported(agent.registry) | exported(RouterMetrics().registry)


def metric_names(expr: str) -> set[str]:
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", e)
    e = re.sub(r"\$\w+", "", e)  # Grafana variables
    idents = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e))
    return {i for i in idents if i not in PROMQL_WORDS}


def expressions() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"]))
    return out


def test_the_extractor() -> None:
    assert metric_names('histogram_quantile(0.99, sum by (le, op) (rate(x_bucket{job=~"$j", a="rate"}'
                        '[$__rate_interval])))') == {"x_bucket"}
    assert metric_names("a / b * on (instance) group_left(node) c") == {"a", "b", "c"}


def test_every_expression_names_an_exported_metric() -> None:
    known = every_export()
    exprs = expressions()
    assert len(exprs) > 20
    unknown = {(title, name) for title, expr in exprs for name in metric_names(expr) if name not in known}
    assert not unknown, sorted(unknown)
    # And the dashboard covers each daemon's own metrics (the list).
    used = {n for _, e in exprs for n in metric_names(e)}
    for name in ("llmgw_server_nodes", "llmgw_server_replicas", "llmgw_server_reconcile_pass_duration_seconds_bucket",
                 "llmgw_server_placement_duration_seconds_bucket", "llmgw_server_messages_received_total",
                 "llmgw_server_refusals_total", "llmgw_server_zap_denials_total",
                 "llmgw_server_store_write_duration_seconds_bucket", "llmgw_agent_engines",
                 "llmgw_agent_engine_restarts_total", "llmgw_agent_health_probe_duration_seconds_bucket",
                 "llmgw_agent_discovery_duration_seconds_bucket", "llmgw_agent_gpu_memory_used_bytes",
                 "llmgw_agent_gpu_utilization_ratio", "llmgw_router_requests_total"):
        assert name in used, name


def test_a_misspelt_metric_would_be_caught() -> None:
    known = every_export()
    assert "llmgw_server_node" not in known and "llmgw_agent_engine_restarts" not in known
    assert "llmgw_server_nodes" in known and "llmgw_agent_engine_restarts_total" in known


def test_dashboard_shape() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "llmgw"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
