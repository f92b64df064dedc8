"""The router service: HTTP front door → balancer → pooled engine connections, started.
The front itself (`Router`: each connection, each request) is front.py; this module binds
its port and runs it with the loops that keep it current.

`serve_router(config, table_source=...)` runs until cancelled. `table_source(since)` is an
async callable returning the endpoint table {"version", "models"} (see table.py); the
router keeps its last table while the source fails. `run_router(config, request)` wires
the real source: the server's "endpoints" op over `llmgw.transport.client.request`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from llmgw.config.addresses import parse_host_port
from llmgw.config.router import RouterConfig
from llmgw.errors import ListenError
from llmgw.rlimit import raise_nofile
from llmgw.router.connection.lag import watch_lag
from llmgw.router.front import Router, TableSource
from llmgw.router.kv.links import serve_kv_links
from llmgw.router.routing.load_report import report_load
from llmgw.router.routing.loadwatch import watch_load
from llmgw.router.tenants.keytable import KeySource, poll_keys
from llmgw.router.tenants.limits import LeaseAsk
from llmgw.router.tenants.sources import tenant_sources
from llmgw.router.tenants.usage_report import UsageSink, report_usage
from llmgw.transport.follow import LeaderClient
from llmgw.transport.requests import EndpointsOp, LoadReportOp

log = logging.getLogger("llmgw.router")

LoadSink = Callable[[LoadReportOp], Awaitable[object]]


def _split_bind(bind: str) -> tuple[str, int]:
    # The config loader checked it (one grammar); in code, port 0 lets the kernel pick.
    return parse_host_port(bind, any_port=True)


async def serve_router(
    config: RouterConfig,
    *,
    table_source: TableSource,
    load_sink: LoadSink | None = None,
    key_source: KeySource | None = None,
    usage_sink: UsageSink | None = None,
    lease_ask: LeaseAsk | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled. `task_status.started((host, port))` gives the bound address."""
    router = Router(config)
    router.limiter.leases.ask = lease_ask
    host, port = _split_bind(config.bind)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ListenError(f"the router cannot listen on {config.bind}: "
                          f"{exc.strerror or exc}") from None
    # After the bind, so that a router that cannot listen says only that; before the
    # first accept, which is what needs the descriptors.
    raise_nofile("router")  # two descriptors per stream in flight; a shell's 1024 is ~500
    bound = listeners[0].socket.getsockname()
    log.info("router listening on http://%s:%d", bound[0], bound[1])
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_lag, router.lag)
            if key_source is not None:
                # Its first answer before the endpoint table's: no request is served
                # without the keys the server wants.
                await nursery.start(poll_keys, router.key_table, key_source,
                                    config.key_table_interval)
            nursery.start_soon(router.poll_table, table_source)
            if router.kv.models:  # kv_aware: what the engines hold, from the agents' relays
                await nursery.start(serve_kv_links, router.kv, config.keys.secret_key)
            if usage_sink is not None:
                nursery.start_soon(report_usage, router.usage, usage_sink,
                                   config.usage_report_interval)
            if lease_ask is not None:  # a new leader learns of our grants (router/tenants/limits.py)
                nursery.start_soon(router.limiter.keep_terms)
            nursery.start_soon(
                watch_load,
                lambda: list(router.table.replicas.values()),
                router._fetch_metrics,
                config.metrics_interval,
            )
            if load_sink is not None:
                nursery.start_soon(report_load, router.load_report, load_sink,
                                   config.load_report_interval, lambda: router.wake)
            nursery.start_soon(trio.serve_listeners, router.handle, listeners)
            task_status.started((bound[0], bound[1]))
    finally:
        router.upstream.close_all()


# A router allocates some dozens of short-lived objects a request and holds few for long:
# CPython's default first-generation threshold (700) runs a collection every ~40 plain
# requests at concurrency 64, each walking the live tasks' frames. Ten times that: the
# young generation may hold a few MB more, and the router spends 5-9% less CPU a request
# (bench/README.md).
GC_GEN0 = 7000


def tune_gc() -> None:
    """The `llmgw router` process's collector settings (run_router's; the bench's too)."""
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0, gen1, gen2)


async def run_router(config: RouterConfig, request: Callable[..., Awaitable[Any]]) -> None:
    """The `llmgw router` entry: table from the server's "endpoints" op via `request`
    (llmgw.transport.client.request), then serve until cancelled."""
    tune_gc()
    timeout = max(2.0, config.table_poll_interval * 2)
    # Several servers: the table comes from whichever leads; while none answers, the
    # last table goes on serving (poll_table keeps it).
    leader = LeaderClient(config.server, request)

    async def source(since: int) -> Mapping[str, Any] | None:
        result = await leader(
            config.keys.secret_key,
            config.keys.server_key,
            EndpointsOp(since),
            timeout,
        )
        return result if isinstance(result, Mapping) else None

    # Load reports on a client of their own: one request at a time each.
    reporter = LeaderClient(config.server, request)

    async def sink(op: LoadReportOp) -> object:
        return await reporter(config.keys.secret_key, config.keys.server_key, op, timeout)

    # API keys, usage and limits: on clients of their own too.
    await serve_router(config, table_source=source, load_sink=sink,
                       **tenant_sources(config, request))
