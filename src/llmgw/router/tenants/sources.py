"""The server's side of API keys as a router reaches it: the key table source,
the usage sink and the lease ask, each on a client of its own (one request at a time
each: a slow usage report never holds up a lease a request waits for). Used by
`llmgw router` (service.run_router) and `llmgw dev`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from llmgw.config.router import RouterConfig
from llmgw.transport.apikey_ops import KeyTableOp, LeaseOp, UsageReportOp
from llmgw.transport.follow import LeaderClient

LEASE_TIMEOUT = 1.0  # a request waits for it (router/tenants/limits.py gives up after 1 s anyway)


def tenant_sources(config: RouterConfig, request: Callable[..., Awaitable[Any]]) -> dict[str, Any]:
    """serve_router's key_source, usage_sink and lease_ask, over `request`
    (llmgw.transport.client.request) to whichever server leads."""
    secret, server_key = config.keys.secret_key, config.keys.server_key
    keys = LeaderClient(config.server, request)
    usage = LeaderClient(config.server, request)
    leases = LeaderClient(config.server, request)
    timeout = max(2.0, config.key_table_interval * 2)

    async def key_source(since: str) -> Mapping[str, Any] | None:
        result = await keys(secret, server_key, KeyTableOp(since), timeout)
        return result if isinstance(result, Mapping) else None

    async def usage_sink(op: UsageReportOp) -> object:
        return await usage(secret, server_key, op, max(2.0, config.usage_report_interval))

    async def lease_ask(op: LeaseOp) -> Mapping[str, Any] | None:
        result = await leases(secret, server_key, op, LEASE_TIMEOUT)
        return result if isinstance(result, Mapping) else None

    return {"key_source": key_source, "usage_sink": usage_sink, "lease_ask": lease_ask}
