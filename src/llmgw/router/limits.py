"""Per-key limits at the router (issue 24): rpm, tpm and budgets spent from leases the
server grants (router/wallet.py; the server's side is server/tenants/limits.py), and concurrent
requests counted here.

Admission costs no round trip while the router holds enough of a lease; when it runs low
it asks for a slice (a twentieth of the limit, at least what the request needs), one ask
per key and limit at a time (others wait for it, then look again). A refusal is kept for
at most a second (the server's retry_after, capped): a client hammering a spent key costs
the server one ask a second per router, not one per request.

Tokens are charged at admission: the prompt's bytes / 4 plus `max_tokens` (or
DEFAULT_MAX_TOKENS), and settled from the engine's usage: what was not used goes back
into the wallet; what was used beyond the estimate is taken from the wallet as far as it
holds (the estimate is the bound; a prompt with more tokens than bytes / 4 is the case it
misses). A request whose estimate alone is over the key's tpm or budget is refused up
front, not after.

Concurrency is exact across routers too: the server leases slots (server/tenants/slots.py
has the argument; router/slots.py the router's side). A request starts while the router
runs fewer of the key's requests than the slots it holds, with no round trip; a router
that is full asks for more (a twentieth of the concurrency, at least one; one ask per key
at a time, a refusal kept for a second as for rates: 429 `rate_limit_exceeded`, "concurrent
requests", Retry-After 1). `keep_terms` renews the slots it holds once a second and gives
back what it did not use in that second, so an idle router holds none; a router that
dies holds its slots for at most a ttl (SLOT_TTL, 10 s), then they are free.

With the server unreachable the router spends the leases and slots it holds, then
follows the key's `on_server_loss` (logged once): by default rates admit, budgets refuse
(503), and concurrency admits up to the key's concurrency on this router alone (as if it
were the only router: exact no more, and bounded); "allow" admits, "deny" refuses (503),
whatever the limit. A server from before slots (it refuses the kind) is not a lost
server: the router counts concurrency alone, as routers did before slots, and says so
once; it asks again a minute later.

Across a change of leader (server/tenants/leases.py has the argument): every ask names the
leader's term the router last heard of. A leader of another term answers `declare`; the
router then sends it every grant of other terms it holds or used that still occupies
(its wallets remember them), and asks again. A new term grants nothing for a few seconds
(`hold`) while routers declare: a request that needs a lease then waits for the hold's
end (once: a request late by up to HOLD_WAIT after a leader's start, not refused; if the
term still holds, 503 `limits_unavailable` with Retry-After, whatever on_server_loss
says: the server is there, and admitting would be admitting beyond the limit). So that
a router with no request to ask for declares too, `keep_terms` probes the leader every
PROBE_EVERY seconds while the router holds or remembers a grant (an ask for nothing,
which also gives back what ran out); it costs nothing otherwise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio
from attrs import define, field

from llmgw.errors import LlmgwError, ProtocolError, RequestFailedError
from llmgw.model.apikey import ApiKeyRecord
from llmgw.model.leases import Grant
from llmgw.router.errors import ApiError
from llmgw.router.slots import SlotLease, SlotWallet
from llmgw.router.wallet import Wallet
from llmgw.transport.apikey_ops import MAX_HELD, NO_TERM, Held, LeaseOp, LeaseResult, LimitKind, Unused
from llmgw.transport.codec import structure_result

log = logging.getLogger("llmgw.router.limits")

LeaseAsk = Callable[[LeaseOp], Awaitable[Mapping[str, Any] | None]]
DEFAULT_MAX_TOKENS = 256  # a request without max_tokens is charged this many
SLICE = 20  # a lease is a twentieth of the limit (at least what the request needs)
REFUSAL_KEPT = 1.0  # seconds a refusal of the server is believed without asking again
LOST_FOR = 2.0  # seconds without asks after the server did not answer
PROBE_EVERY = 1.0  # seconds between asks for nothing while the router holds grants
MINUTE = 60.0
HOLD_WAIT = 3.0  # seconds a request waits at most for a new term's hold (limits.py HOLD)
NO_SLOTS_FOR = 60.0  # seconds a server that refused the slots' kind is not asked again


def estimate(body: Mapping[str, Any], body_bytes: int) -> int:
    m = body.get("max_tokens", body.get("max_completion_tokens"))
    out = m if type(m) is int and m >= 0 else DEFAULT_MAX_TOKENS
    return body_bytes // 4 + out


def rate_limited(key: str, what: str, limit: int, retry: float) -> ApiError:
    secs = max(1, math.ceil(retry))
    return ApiError(429, f"Rate limit reached for API key {key} on {what}: limit {limit}. "
                    f"Please try again in {secs}s.", type_="tokens" if "token" in what else "requests",
                    code="rate_limit_exceeded", retry_after=secs)


def quota(key: str, detail: str, retry: float) -> ApiError:
    return ApiError(429, f"You exceeded the token budget of API key {key}: {detail}.",
                    type_="insufficient_quota", code="insufficient_quota",
                    retry_after=max(1, math.ceil(retry)))


@define
class Charge:
    key: ApiKeyRecord
    tokens: int = 0  # charged to tpm and budget wallets
    kinds: list[LimitKind] = field(factory=list)
    running: bool = False


@define
class _Gate:
    wallets: dict[LimitKind, Wallet] = field(factory=dict)
    # Until when a refusal is believed, and when the server said units are free again.
    refused_until: dict[LimitKind, tuple[float, float]] = field(factory=dict)
    locks: dict[LimitKind, trio.Lock] = field(factory=dict)
    slots: SlotWallet = field(factory=SlotWallet)


class Limiter:
    def __init__(self, ask: LeaseAsk | None) -> None:
        self.ask = ask
        self.gates: dict[str, _Gate] = {}  # per key name: keys of the table only, bounded
        self.unused: list[Unused] = []  # lease units to give back on the next ask
        self.lost_until = -math.inf
        self.lost_admits = 0  # requests admitted on a rate limit the server could not lease
        self._lost_logged = False
        self.term = NO_TERM  # the leader's term last heard of (server/tenants/limits.py)
        self.declared = 0  # grants declared to leaders of new terms, for the log and tests
        self._redeclare = False  # a grant of an old term came after the new one's
        self._hold_logged = ""
        self.hold_until = -math.inf  # a new term's hold: asks wait until then
        self.no_slots_until = -math.inf  # a server from before slots: counted alone until
        self._no_slots_logged = False

    def applies(self, key: ApiKeyRecord) -> bool:
        return bool(key.rpm or key.tpm or key.concurrency or key.budget)

    async def admit(self, key: ApiKeyRecord, tokens: int) -> Charge:
        """Admit one request charged `tokens`, or raise ApiError (429, or 503 for a budget
        the server cannot be asked about)."""
        gate = self.gates.get(key.name)
        if gate is None:
            gate = self.gates[key.name] = _Gate()
        if key.tpm and tokens > key.tpm:
            raise rate_limited(key.name, "tokens per minute (one request's estimate alone, "
                               f"{tokens} tokens, is over it)", key.tpm, 60)
        if key.budget and tokens > key.budget.tokens:
            raise quota(key.name, f"one request's estimate ({tokens} tokens) is over the "
                        f"whole budget of {key.budget.tokens}", key.budget.period)
        charge = Charge(key, tokens)
        if key.concurrency:
            if gate.slots.running >= key.concurrency:  # a limit lowered: at once here too
                raise rate_limited(key.name, "concurrent requests", key.concurrency, 1)
            if not gate.slots.start(trio.current_time()):  # the usual case: a slot held
                await self._slot(gate, key)
            charge.running = True
        try:
            for kind, units, limit in ((LimitKind.RPM, 1, key.rpm), (LimitKind.TPM, tokens, key.tpm),
                                       (LimitKind.BUDGET, tokens,
                                        key.budget.tokens if key.budget else 0)):
                if limit and units:
                    if await self._spend(gate, key, kind, units, limit):
                        charge.kinds.append(kind)
        except ApiError:
            self._rollback(gate, charge)
            raise
        return charge

    async def _slot(self, gate: _Gate, key: ApiKeyRecord) -> None:
        """Start a request of `key` on a slot (asking the server for more), or as
        on_server_loss says while the server is away; else raise ApiError (429)."""
        sw = gate.slots
        kind = LimitKind.CONCURRENCY
        lock = gate.locks.get(kind)
        if lock is None:
            lock = gate.locks[kind] = trio.Lock()
        async with lock:
            now = trio.current_time()
            if sw.start(now):  # another request's ask brought some, or one ended
                return
            until, _ = gate.refused_until.get(kind, (0.0, 0.0))
            if now < until:
                raise rate_limited(key.name, "concurrent requests", key.concurrency, 1)
            if self.ask is None or now < self.no_slots_until:
                return self._alone(sw, key)
            if now < self.lost_until:
                return self._slot_lost(sw, key)
            held = sw.held(now)
            want = min(key.concurrency, max(1, math.ceil(key.concurrency / SLICE))
                       + max(0, sw.running - held))
            try:
                got, sent = await self._lease(key.name, kind, want, give_back=False)
            except (RequestFailedError, ProtocolError) as exc:  # a server from before slots
                if not self._no_slots_logged:
                    log.warning("the server does not lease concurrency slots (%s): each "
                                "router counts a key's concurrency alone", exc)
                    self._no_slots_logged = True
                self.no_slots_until = trio.current_time() + NO_SLOTS_FOR
                return self._alone(sw, key)
            except (LlmgwError, trio.TooSlowError, OSError) as exc:
                self._server_lost(exc)
                return self._slot_lost(sw, key)
            if self._lost_logged:
                log.info("the server grants leases again")
                self._lost_logged = False
            if got.hold > 0 or got.declare:
                raise self._held(key, max(got.hold, 1.0))
            if got.units <= 0:
                wait = min(got.retry_after, REFUSAL_KEPT)
                gate.refused_until[kind] = (sent + wait, sent + wait)
                raise rate_limited(key.name, "concurrent requests", key.concurrency, 1)
            if got.term and self.term not in (got.term, NO_TERM):
                self._redeclare = True
            elif got.term:
                self.term = got.term
            sw.add(SlotLease(got.term, got.grant_id, got.units, sent + got.ttl))
            if not sw.start(trio.current_time()):
                raise rate_limited(key.name, "concurrent requests", key.concurrency, 1)

    def _alone(self, sw: SlotWallet, key: ApiKeyRecord) -> None:
        """Counted on this router alone (no server to ask, or one from before slots)."""
        if sw.running >= max(key.concurrency, sw.held(trio.current_time())):
            raise rate_limited(key.name, "concurrent requests", key.concurrency, 1)
        sw.started()

    def _slot_lost(self, sw: SlotWallet, key: ApiKeyRecord) -> None:
        """The server is unreachable and the slots held are taken: on_server_loss."""
        if key.on_server_loss == "deny":
            raise ApiError(503, f"The concurrency of API key {key.name} cannot be checked "
                           "while the control plane is unreachable; try again shortly.",
                           type_="server_error", code="limits_unavailable", retry_after=5)
        self._alone(sw, key)
        self.lost_admits += 1

    def _server_lost(self, exc: BaseException) -> None:
        if not self._lost_logged:
            log.warning("cannot ask the server for leases (%s): rate limits admit, budgets "
                        "refuse, concurrency admits up to each key's on this router alone, "
                        "until it answers", exc)
            self._lost_logged = True
        self.lost_until = trio.current_time() + LOST_FOR

    async def _spend(self, gate: _Gate, key: ApiKeyRecord, kind: LimitKind, units: int,
                     limit: int) -> bool:
        """True when spent from a lease; False when admitted without one (server lost,
        a rate); raises ApiError when refused."""
        w = gate.wallets.get(kind)
        if w is None:
            w = gate.wallets[kind] = Wallet(key.budget.period if kind is LimitKind.BUDGET
                                            and key.budget else MINUTE)
        now = trio.current_time()
        if w.spend(units, now):
            return True
        lock = gate.locks.get(kind)
        if lock is None:
            lock = gate.locks[kind] = trio.Lock()
        async with lock:
            now = trio.current_time()
            if w.spend(units, now):  # another request's ask brought some
                return True
            until, free_at = gate.refused_until.get(kind, (0.0, 0.0))
            if now < until:
                raise self._refusal(key, kind, limit, free_at - now)
            if self.ask is None or now < self.lost_until:
                return self._lost(key, kind, limit)
            self._give_back_expired(now)
            want = max(units, math.ceil(limit / SLICE))
            try:
                got, sent = await self._lease(key.name, kind, want)
            except (LlmgwError, trio.TooSlowError, OSError) as exc:
                self._server_lost(exc)
                return self._lost(key, kind, limit)
            if self._lost_logged:
                log.info("the server grants leases again")
                self._lost_logged = False
            if got.hold > 0 or got.declare:  # still counting after waiting for it
                raise self._held(key, max(got.hold, 1.0))
            if got.units <= 0:
                gate.refused_until[kind] = (sent + min(got.retry_after, REFUSAL_KEPT),
                                            sent + got.retry_after)
                raise self._refusal(key, kind, limit, got.retry_after)
            if got.term and self.term not in (got.term, NO_TERM):
                self._redeclare = True  # granted by an old term after we heard of the new
            elif got.term:
                self.term = got.term
            w.add(Grant(got.grant_id, "", got.units, sent, sent + got.ttl, got.term))
            if w.spend(units, trio.current_time()):
                return True
            raise self._refusal(key, kind, limit, 1.0)  # fewer than the request needs

    async def _lease(self, name: str, kind: LimitKind, want: int,
                     give_back: bool = True) -> tuple[LeaseResult, float]:
        """Ask for `want` units: the answer and when the ask that got it was sent. A new
        term's `declare` is answered (our grants of other terms, then ask again); its
        `hold` is waited out (at most HOLD_WAIT, then ask again): the request is late
        once, not refused."""
        for _ in range(3):
            if trio.current_time() < self.hold_until:
                await trio.sleep_until(self.hold_until)
            sent = trio.current_time()
            got = await self._ask(LeaseOp(name, kind, want, tuple(self.unused) if give_back else (),
                                          self.term))
            if got.declare:
                await self._declare()
            elif got.hold > 0:
                if self._hold_logged != got.term:
                    log.info("a new leader's term (%s) grants leases in %.1fs, once routers "
                             "have declared theirs: requests that need one wait for it",
                             got.term, got.hold)
                    self._hold_logged = got.term
                # From the answer's arrival, not the ask's sending: the server measured
                # `hold` when the ask reached it, so a wake-up counted from `sent` comes
                # early by the ask's transit, asks again inside the hold, and after three
                # tries the request got 503 limits_unavailable (seen in CI on a fresh
                # server, whose first ask starts a hold, under load).
                self.hold_until = trio.current_time() + min(got.hold, HOLD_WAIT)
            else:
                return got, sent
        return got, sent

    async def _ask(self, op: LeaseOp) -> LeaseResult:
        assert self.ask is not None
        with trio.fail_after(1.0):
            raw = await self.ask(op)
        if op.unused:
            self.unused = []
        got = structure_result(raw or {}, LeaseResult)
        if got.declare:
            self.term = got.term
        return got

    async def _declare(self) -> None:
        """Every grant of other terms than the leader's that still occupies, to the leader
        (in messages of at most MAX_HELD)."""
        now = trio.current_time()
        held = [Held(name, kind, g.term, g.id, units, left)
                for name, gate in self.gates.items() for kind, w in gate.wallets.items()
                for g, units, left in w.held(now, self.term)]
        self._redeclare = False
        for i in range(0, len(held), MAX_HELD):
            chunk = tuple(held[i:i + MAX_HELD])
            got = await self._ask(LeaseOp(chunk[0].key, chunk[0].kind, 0, (), self.term, chunk))
            if got.declare:  # yet another term meanwhile: declare to it from the start
                self._redeclare = True
                return
        self.declared += len(held)
        if held:
            log.info("declared %d grant(s) of earlier terms to the leader's term %s", len(held),
                     self.term)
        await self._renew_slots()  # the new term adopts the slots of others it is told of

    async def _renew_slots(self) -> None:
        """Renew the slots held (giving back what was not used since the last time), in ops
        of their own: a server from before slots refuses them and nothing else."""
        now = trio.current_time()
        if now < self.no_slots_until:
            return
        mine = [(name, lease, keep) for name, gate in self.gates.items()
                for lease, keep in gate.slots.renewals(now)]
        for i in range(0, len(mine), MAX_HELD):
            chunk = mine[i:i + MAX_HELD]
            held = tuple(Held(name, LimitKind.CONCURRENCY, lease.term, lease.id, keep,
                              lease.ends - now) for name, lease, keep in chunk)
            sent = trio.current_time()
            got = await self._ask(LeaseOp(held[0].key, LimitKind.CONCURRENCY, 0, (), self.term, held))
            if got.declare:  # a new term: declare to it (this again, under its name)
                self._redeclare = True
                return
            for (name, lease, _), kept in zip(chunk, got.kept, strict=False):
                gate = self.gates.get(name)
                if gate is not None:
                    gate.slots.renewed(lease, kept, sent, got.ttl)

    async def keep_terms(self, every: float = PROBE_EVERY) -> None:
        """While the router holds or remembers grants, ask the leader for nothing every
        `every` seconds: it learns of a new term (and declares) without waiting for a
        request, and gives back what ran out. Runs until cancelled."""
        while True:
            await trio.sleep(every)
            now = trio.current_time()
            if self.ask is None or self.term == NO_TERM:
                continue
            first = next(((name, kind) for name, gate in self.gates.items()
                          for kind, w in gate.wallets.items() if w.remembers(now)), None)
            try:
                if any(gate.slots.leases for gate in self.gates.values()):
                    await self._renew_slots()  # first: what is given back is free sooner
                if first is not None:
                    self._give_back_expired(now)
                    got = await self._ask(LeaseOp(first[0], first[1], 0, tuple(self.unused),
                                                  self.term))
                    if got.declare:
                        self._redeclare = True
                if self._redeclare:
                    await self._declare()
            except (RequestFailedError, ProtocolError) as exc:
                log.debug("lease probe: %s", exc)  # a server from before slots: they lapse
            except (LlmgwError, trio.TooSlowError, OSError) as exc:
                log.debug("lease probe: %s", exc)  # the asks of requests log the loss

    def _refusal(self, key: ApiKeyRecord, kind: LimitKind, limit: int, retry: float) -> ApiError:
        if kind is LimitKind.BUDGET:
            return quota(key.name, f"{limit} tokens per budget period", retry)
        what = "requests per minute" if kind is LimitKind.RPM else "tokens per minute"
        return rate_limited(key.name, what, limit, retry)

    def _held(self, key: ApiKeyRecord, retry: float) -> ApiError:
        """A new leader's term counts what routers hold before it grants (the server is
        there: not on_server_loss's case; admitting would be admitting beyond the limit)."""
        return ApiError(503, f"The limits of API key {key.name} are being counted again after "
                        "a change of control-plane leader; try again shortly.",
                        type_="server_error", code="limits_unavailable",
                        retry_after=max(1, math.ceil(retry)))

    def _lost(self, key: ApiKeyRecord, kind: LimitKind, limit: int) -> bool:
        deny = key.on_server_loss == "deny" or (kind is LimitKind.BUDGET
                                                and key.on_server_loss != "allow")
        if deny and kind is not LimitKind.BUDGET:
            raise ApiError(503, f"The rate limits of API key {key.name} cannot be checked "
                           "while the control plane is unreachable; try again shortly.",
                           type_="server_error", code="limits_unavailable", retry_after=5)
        if deny:
            raise ApiError(503, f"The token budget of API key {key.name} cannot be checked "
                           "while the control plane is unreachable; try again shortly.",
                           type_="server_error", code="budget_unavailable", retry_after=5)
        self.lost_admits += 1
        return False

    def settle(self, charge: Charge, used_tokens: int | None) -> None:
        """The request ended: its concurrency slot back, its token charge settled against
        `used_tokens` (None: unknown, the charge stands)."""
        gate = self.gates.get(charge.key.name)
        if gate is None:
            return
        if charge.running:
            gate.slots.ended()
            charge.running = False
        if used_tokens is None:
            return
        now = trio.current_time()
        for kind in charge.kinds:
            w = gate.wallets.get(kind)
            if w is None:
                continue
            if kind is LimitKind.RPM:
                continue
            if used_tokens < charge.tokens:
                w.refund(charge.tokens - used_tokens, now)
            elif used_tokens > charge.tokens:
                w.spend(min(used_tokens - charge.tokens, w.available(now)), now)

    def _rollback(self, gate: _Gate, charge: Charge) -> None:
        """A request refused by a later limit: what the earlier ones took goes back."""
        now = trio.current_time()
        for kind in charge.kinds:
            w = gate.wallets.get(kind)
            if w is not None:
                w.refund(1 if kind is LimitKind.RPM else charge.tokens, now)
        charge.kinds = []
        if charge.running:
            gate.slots.ended()
            charge.running = False

    def _give_back_expired(self, now: float) -> None:
        for name, gate in self.gates.items():
            for kind, w in gate.wallets.items():
                for g, left in w.ended(now):
                    if g.id and left:
                        self.unused.append(Unused(name, kind, g.id, left, g.term))
        del self.unused[4000:]  # bounded; what is not given back frees at its lease's end
