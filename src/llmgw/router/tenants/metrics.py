"""The router's metrics of API keys, usage and limits: how many keys it checks,
whether the server answers its lease asks, what it admitted without a lease, and the
usage it has not yet handed over."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.router.tenants.keytable import KeyTable
from llmgw.router.tenants.limits import Limiter
from llmgw.router.tenants.usage import UsageMeter


def tenant_families(table: KeyTable, limiter: Limiter, meter: UsageMeter,
                    now: float) -> Iterator[Metric]:
    yield GaugeMetricFamily("llmgw_router_api_keys",
                            "API keys in the key table from the server (0: the server holds "
                            "none; api_keys_file or no authentication then)", value=len(table.keys))
    yield GaugeMetricFamily("llmgw_router_limits_server_lost",
                            "1 while the server does not answer lease asks (keys follow their "
                            "on_server_loss), else 0", value=1 if now < limiter.leases.lost_until else 0)
    yield CounterMetricFamily("llmgw_router_limits_admitted_without_lease",
                              "Requests admitted on a rate limit or a concurrency while the "
                              "server could not be asked for a lease or slot",
                              value=limiter.lost_admits)
    yield GaugeMetricFamily("llmgw_router_usage_unsent",
                            "Requests metered and not yet acknowledged by the server",
                            value=meter.unsent)
