"""The router's front: `Router` holds the endpoint table, the keys, limits and usage, the
admission gates and the pooled engine connections, and serves each client connection
(`handle`): a request is dispatched, and a proxied one goes through its checks (key,
JSON, model, hold for a model at zero, limits, admission) to up to MAX_TRIES replicas,
relayed by `connection.relay.Relay`. The loops that keep it current (the table poll, the
load report) are its methods too; service.py starts them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from llmgw.config.router import ModelRouteConfig, RouterConfig
from llmgw.errors import ProtocolError
from llmgw.logbound import Throttle
from llmgw.model.apikey import ApiKeyRecord
from llmgw.router import errors
from llmgw.router.connection import failover, sockio
from llmgw.router.connection.http import ClientConn, H1Error, Request
from llmgw.router.connection.jsondepth import MAX_DEPTH, too_deep
from llmgw.router.connection.lag import LagMeter
from llmgw.router.connection.relay import ClientGone, Failed, Migrate, Relay
from llmgw.router.connection.upstream import UpstreamPool, fetch_text
from llmgw.router.crash import cancel_part, crashed, unexpected
from llmgw.router.errors import JSON, ApiError
from llmgw.router.exchange import Exchange
from llmgw.router.kv.policy import KvRouting
from llmgw.router.metrics import CONTENT_TYPE as METRICS_TYPE
from llmgw.router.metrics import RouterMetrics
from llmgw.router.routing.admission import Gate, Refused
from llmgw.router.routing.balancer import Replica, prefix_key
from llmgw.router.routing.classes import HEADER as CLASS_HEADER
from llmgw.router.routing.classes import Classes
from llmgw.router.routing.hold import HoldRefused, Holds
from llmgw.router.routing.load_report import LoadCounter
from llmgw.router.routing.priority import FIELD as PRIORITY
from llmgw.router.routing.priority import EngineBodies
from llmgw.router.routing.table import EndpointTable
from llmgw.router.tenants.auth import ApiKey, KeyFile
from llmgw.router.tenants.keytable import KeyTable
from llmgw.router.tenants.limits import Charge, Limiter, estimate
from llmgw.router.tenants.metrics import tenant_families
from llmgw.router.tenants.usage import UsageMeter, UsageTap, usage_body
from llmgw.transport.requests import LoadReportOp

log = logging.getLogger("llmgw.router")

TableSource = Callable[[int], Awaitable[Mapping[str, Any] | None]]
# While requests are held for a model at zero, the table is asked for this often: they go
# the moment its first replica is ready, not up to a poll interval later.
HOLD_POLL = 0.1
PROXIED = {b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"}
MAX_TRIES = 3
DEFAULT_ROUTE = ModelRouteConfig()


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        # kv_aware pools carry the affinity ring too: their fallback (router/kv/policy.py).
        policies = {
            name: (m.policy in ("prefix_affinity", "kv_aware"), m.prefix_chars)
            for name, m in config.models.items()
        }
        self.table = EndpointTable(policies)
        # kv_aware models: their tokenizers (read here, once) and block indexes.
        self.kv = KvRouting(config.models)
        self.keys = KeyFile(config.api_keys_file) if config.api_keys_file else None
        # The server's API keys (API keys and limits); once it has any, they win over api_keys_file.
        self.key_table = KeyTable()
        # Usage per key × model, metered while the server's keys are in use.
        self.usage = UsageMeter()
        # Per-key rpm, tpm, budgets (leases from the server) and concurrency (API keys and limits).
        self.limiter = Limiter(None)
        self.metrics = RouterMetrics()
        self.lag = LagMeter()
        self.upstream = UpstreamPool(
            config.connect_timeout, max_connecting=config.max_connecting_per_replica, lag=self.lag
        )
        self.relay = Relay(self.upstream, config, self.metrics, self._failed)
        # Per served model: its admission queue (models of the table only: bounded).
        self.gates: dict[str, Gate] = {}
        # Priority classes (router.toml's `classes`): the bands of every model's queue.
        self.classes = Classes(config)
        self._per_replica = config.max_requests_per_replica
        # Autoscale (scale to zero): requests held for models at zero, arrivals per model for
        # the load report, and the event that sends a report at once (a wake).
        self.holds = Holds(config.hold_queue, config.cold_start_budget)
        self.load = LoadCounter()
        self.wake = trio.Event()
        m = self.metrics
        m.queues = lambda: {name: g.queued for name, g in self.gates.items()}
        m.bands = lambda: {(name, b.name): g.waiting(b.name) for name, g in self.gates.items()
                           for b in self.classes.bands}
        m.loop_lag = self.lag.take_worst
        m.loop_late_total = lambda: self.lag.total
        m.forgiven = lambda: self.upstream.forgiven
        m.kv = lambda: self.kv.families(self.table.pools, self.table.bases)
        m.tenants = lambda: tenant_families(self.key_table, self.limiter, self.usage,
                                            trio.current_time())
        self._stale = config.metrics_stale_after
        self._crash_log = Throttle(burst=5, period=60.0, clock=time.monotonic)

    # ---- background loops -------------------------------------------------------------

    async def poll_table(self, source: TableSource) -> None:
        failing = False
        while True:
            try:
                snap = await source(self.table.version)
            except Exception as exc:  # the source is foreign code: log, keep the last table
                if not failing:
                    log.warning(
                        "endpoint table source failed (%s); serving from table version %d",
                        exc,
                        self.table.version,
                    )
                failing = True
            else:
                if failing:
                    log.info("endpoint table source answers again")
                failing = False
                try:
                    changed = bool(snap) and self.table.apply(snap)  # type: ignore[arg-type]
                except ProtocolError as exc:  # the server's answer is peer input too
                    self._crash_log.log(log, logging.WARNING, "table",
                                        "ignored a malformed endpoint table (%s); serving from version %d",
                                        exc, self.table.version)
                    changed = False
                if changed:
                    self._gates_follow_table()
                    self.kv.table_changed(self.table.rows)
                    self._release_holds()
                    log.info(
                        "endpoint table version %d: %s",
                        self.table.version,
                        {m: len(p.replicas) for m, p in self.table.pools.items()},
                    )
            poll = self.config.table_poll_interval
            await trio.sleep(min(poll, HOLD_POLL) if self.holds.any else poll)

    def _release_holds(self) -> None:
        """Held requests go once their model has a ready replica, or is cold no more."""
        for name in list(self.holds.queues):
            pool = self.table.pools.get(name)
            if (pool is not None and pool.any_ready()) or name not in self.table.cold:
                n = self.holds.release(name)
                log.info("%d held requests for %s go on: %s", n, name,
                         "a replica is ready" if pool is not None and pool.any_ready()
                         else "it is no longer scaled to zero")

    def load_report(self, woken: bool) -> LoadReportOp:
        if woken:
            self.wake = trio.Event()
        queued = {name: g.queued for name, g in self.gates.items()}
        held = {name: q.count for name, q in self.holds.queues.items()}
        models = self.load.take(self.table, queued, held, trio.current_time(), self._stale)
        return LoadReportOp(models, interval=self.config.load_report_interval, wake=woken)

    async def _hold(self, model: str, since: float) -> None:
        """Wait for the first replica of `model`, scaled to zero; tell the server now."""
        if self.load.wake_due(model, trio.current_time()):
            self.wake.set()
        try:
            await self.holds.hold(model, since)
        except HoldRefused as exc:
            self.metrics.refuse(model, exc.why)
            raise errors.cold(model, str(exc)) from None

    def _capacity(self, model: str) -> int:
        pool = self.table.pools.get(model)
        return pool.n_ready * self._per_replica if pool is not None else 0

    def _gates_follow_table(self) -> None:
        """A new table: more (or fewer) slots per model; gates of models gone, idle, go."""
        for name, gate in list(self.gates.items()):
            if name in self.table.pools:
                gate.pump(self._capacity(name))
            elif not gate.active and not gate.queued:
                del self.gates[name]

    async def _fetch_metrics(self, r: Replica, timeout: float) -> str:
        return await fetch_text(self.upstream, r.host, r.port, b"/metrics", timeout, r.auth)

    # ---- per connection -----------------------------------------------------------------

    async def handle(self, stream: trio.SocketStream) -> None:
        """One client connection. Nothing but cancellation leaves it: whatever goes wrong
        costs this connection (answered 500 when no response head went out yet, closed,
        logged, counted), never the listener."""
        sock = sockio.adopt(stream)
        client = ClientConn(
            sock, self.config.max_body_bytes, self.config.idle_timeout, self.config.header_timeout
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.read_loop)
                try:
                    await self._serve(client)
                finally:
                    nursery.cancel_scope.cancel()
        except BaseException as exc:  # noqa: BLE001 - sorted below; cancellation re-raised
            bug = unexpected(exc)
            if bug is not None:
                await crashed(client, bug, self.metrics, self._crash_log)
            cancel = cancel_part(exc)
            if cancel is exc:
                raise
            if cancel is not None:
                raise cancel from None
        finally:
            sockio.close(sock)


    async def _serve(self, client: ClientConn) -> None:
        while True:
            try:
                req = await client.next_request()
            except H1Error as exc:
                if client.can_respond:
                    err = errors.protocol(exc.status, exc.message)
                    await client.respond(err.status, JSON, err.body(), close=True)
                self.metrics.count("", exc.status)
                return
            if req is None:
                return
            await self.dispatch(client, req)

    async def dispatch(self, client: ClientConn, req: Request) -> None:
        target = req.target
        q = target.find(b"?")
        path = target if q < 0 else target[:q]
        try:
            if path in PROXIED:
                if req.method != b"POST":
                    raise errors.method_not_allowed(req.method.decode(), path.decode())
                await self.proxy(client, req, path)
            elif path == b"/v1/models":
                key = self._auth(req)
                # A model scaled to zero is listed: a request for it is held and wakes it.
                names = sorted({*self.table.ready_models(), *self.table.cold})
                if key is not None:
                    names = [n for n in names if key.allows(n)]
                data = [self._card(n) for n in names]
                body = json.dumps({"object": "list", "data": data}).encode()
                await client.respond(200, JSON, body)
            elif path == b"/health":
                await client.respond(200, JSON, b'{"status":"ok"}')
            elif path == b"/metrics":
                await client.respond(200, METRICS_TYPE, self.metrics.render())
            else:
                raise errors.not_found(path.decode(errors="replace"))
        except ApiError as err:
            if client.can_respond:
                await client.respond(err.status, JSON, err.body(), extra=err.headers())

    def _card(self, name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}
        base = self.table.bases.get(name)
        if base is not None:  # as vLLM lists a LoRA adapter: its base as parent
            card["parent"] = base
        return card

    def _auth(self, req: Request) -> ApiKey | ApiKeyRecord | None:
        if self.key_table.in_use:
            stored, why = self.key_table.check(req.header(b"authorization"), time.time())
            if stored is None:
                raise errors.unauthorized(why)
            return stored
        if self.keys is None:
            return None
        key = self.keys.check(req.header(b"authorization"), trio.current_time())
        if key is None:
            raise errors.unauthorized("Incorrect or missing API key.")
        return key

    async def proxy(self, client: ClientConn, req: Request, path: bytes) -> None:
        t0 = trio.current_time()
        ex = Exchange(client, req, path, t0)
        status = 500
        metrics = self.metrics
        metrics.in_flight += 1
        charge: Charge | None = None
        metered = self.key_table.in_use  # the server's keys: usage per key × model
        try:
            key = ex.key = self._auth(req)
            if too_deep(req.body):
                raise errors.too_deep(MAX_DEPTH)
            try:
                body = json.loads(req.body)
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                raise errors.bad_json(str(exc)) from None
            if not isinstance(body, dict):
                raise errors.bad_json("expected a JSON object")
            m = body.get("model")
            if not isinstance(m, str) or not m:
                raise errors.no_model()
            classes = self.classes
            band = classes.band(classes.of_key(key.name, key.priority_class) if key is not None
                                else classes.default, req.header(CLASS_HEADER))
            pool = self.table.pools.get(m)
            if key is not None and not key.allows(m):
                raise errors.unknown_model(m)
            if pool is not None or m in self.table.cold:  # the table's names only: bounded
                self.load.arrive(m)
            now = t0
            if (pool is None or not pool.any_ready()) and m in self.table.cold:
                await self._hold(m, t0)
                pool = self.table.pools.get(m)
                now = trio.current_time()
            if pool is None or not pool.any_ready():
                why = self.table.waiting.get(m)
                if why is not None:
                    raise errors.not_ready(m, why)
                if self.table.version < 0:
                    raise errors.no_replica(m)
                if pool is None:
                    raise errors.unknown_model(m)
            ex.model = m
            if isinstance(key, ApiKeyRecord) and self.limiter.applies(key):
                tokens = estimate(body, len(req.body))
                charge = (self.limiter.admit_now(key, tokens, now)
                          or await self.limiter.admit(key, tokens))
            streaming = ex.streaming = body.get("stream") is True
            if metered:
                # An HTTP/1.0 client's stream comes unchunked: the usage event could not be
                # taken out, so the engine is not asked for it (its tokens go uncounted).
                ex.body = usage_body(body, req.body) if streaming and not client.http10 else None
                ex.tap = UsageTap(streaming, ex.body is not None)
            if streaming and not client.http10 and self._route(m).failover_migrations:
                ex.follow = failover.follow_for(path, body, ex.body is not None
                                                or failover.asks_usage(body))
            if pool.affinity:
                ex.affinity = prefix_key(body, pool.prefix_chars)
                if self.kv.on:
                    ex.kv = await self.kv.keys(m, self.table.bases.get(m), body, len(req.body), path)
            if PRIORITY in body or self.table.priority:
                ex.engine = EngineBodies(body, ex.body, classes.vllm_priority(band),
                                         usage_body if ex.body is not None else None)
            gate = self.gates.get(m)
            if gate is None:
                gate = self.gates[m] = Gate(self.config.queue_size, bands=classes.bands,
                                            default=classes.default.name)
            waited = 0.0
            if not gate.try_enter(pool.n_ready * self._per_replica):
                try:
                    waited = await gate.enter(pool.n_ready * self._per_replica, t0, band,
                                              key.name if key is not None else "")
                except Refused as exc:
                    metrics.refuse(m, exc.why)
                    metrics.shed_one(m, exc.band, exc.why)
                    raise errors.overloaded(m, str(exc)) from None
                pool = self.table.pools.get(m) or pool  # the table may have moved on meanwhile
            metrics.queue_wait.observe((m, band.name), waited)
            try:
                status = await self._forward(ex, pool)
            finally:
                gate.leave(self._capacity(m))
        except ApiError as err:
            status = err.status
            if client.can_respond:
                await client.respond(err.status, JSON, err.body(), extra=err.headers())
        finally:
            metrics.in_flight -= 1
            end = trio.current_time()
            took = end - t0
            model, key, tap = ex.model, ex.key, ex.tap
            metrics.done(model, status, took)
            if charge is not None:
                self.limiter.settle(charge, tap.prompt + tap.completion
                                    if tap is not None and tap.seen else None, end)
            if metered:
                self.usage.add(key.name if key is not None else "", model, status,
                               tap.prompt if tap is not None else 0,
                               tap.completion if tap is not None else 0, took, time.time())

    async def _forward(self, ex: Exchange, pool: Any) -> int:
        """Try up to MAX_TRIES replicas; returns the status the client got. The clock is
        read again only for a further try (the first goes at the request's `t0`)."""
        tried: tuple[Replica, ...] = ()
        last = ""
        now = ex.t0
        model = ex.model
        for _ in range(MAX_TRIES):
            if tried:
                now = trio.current_time()
            r = (self.kv.choose(ex.kv[0], ex.kv[1], pool, now, self._stale, tried) if ex.kv is not None
                 else pool.choose(now, self._stale, ex.affinity, tried))
            if r is None:
                break
            tried += (r,)
            if ex.engine is not None:  # the `priority` field as this engine should see it
                ex.body = ex.engine.for_engine(r.replica_id in self.table.priority)
            broke: Migrate | None = None
            r.outstanding += 1
            try:
                return await self.relay.run(ex, r, now)
            except ClientGone:
                return 499  # the client went away; nothing to answer
            except Migrate as m:
                broke = m
            except Failed as f:
                last = f"{r.replica_id}: {f}"
                if f.eject:
                    self._failed(model, r, str(f))
                if not f.retry:
                    raise ApiError(504, str(f), type_="server_error", code="upstream_timeout") from None
            finally:
                r.outstanding -= 1
            if broke is not None:
                return await self._carry_on(ex, pool, r, broke)
        if not tried:
            raise errors.no_replica(model)
        raise errors.upstream_failed(model, last)

    def _route(self, model: str) -> ModelRouteConfig:
        return self.config.models.get(model) or DEFAULT_ROUTE

    async def _carry_on(self, ex: Exchange, pool: Any, broke: Replica, m: Migrate) -> int:
        """A stream broke mid-answer and may go on: another replica of the model carries
        on into the same client response (connection/failover.py)."""
        stale = self._stale

        def choose(tried: tuple[Replica, ...]) -> Replica | None:
            now = trio.current_time()
            return (self.table.pools.get(ex.model) or pool).choose(now, stale, ex.affinity, tried)

        return await failover.carry_on(
            self.relay, ex, choose, self._failed, broke, m.why,
            migrations=self._route(ex.model).failover_migrations,
            timeout=self.config.failover_timeout, status=200,
            takes_priority=lambda r: r.replica_id in self.table.priority)

    def _failed(self, model: str, r: Replica, why: str) -> None:
        """A failure of `r` serving `model`: counted; ejected only on the balancer's
        evidence (several in a row while another replica answers)."""
        now = trio.current_time()
        pool = self.table.pools.get(model)
        if pool is None or not pool.note_failure(r, now, self.config.eject_after):
            return
        if now >= r.ejected_until:
            log.warning(
                "replica %s (%s) ejected for %gs: %s", r.replica_id, r.url, self.config.eject_for, why
            )
            self.metrics.ejections.labels(r.replica_id).inc()
        r.ejected_until = now + self.config.eject_for
        self.upstream.drop_host(r.host, r.port)
