"""Per-key limits at the router (API keys and limits): rpm, tpm and budgets spent from leases the
server grants (router/tenants/wallet.py; the server's side is server/tenants/limits.py), and concurrent
requests counted here. The asks, the leader's terms and the renewals are router/tenants/leases.py's.

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
has the argument; router/tenants/slots.py the router's side). A request starts while the router
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

Across a change of leader, a request that needs a lease waits for a new term's hold
(router/tenants/leases.py); if the term still holds, 503 `limits_unavailable` (`_held`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import trio

from llmgw.errors import LlmgwError, ProtocolError, RequestFailedError
from llmgw.model.apikey import ApiKeyRecord
from llmgw.model.leases import Grant
from llmgw.router.errors import ApiError
from llmgw.router.tenants.leases import PROBE_EVERY, Gate, LeaseAsk, Leases
from llmgw.router.tenants.slots import SlotLease, SlotWallet
from llmgw.router.tenants.wallet import Wallet
from llmgw.transport.apikey_ops import LimitKind

__all__ = ["DEFAULT_MAX_TOKENS", "SLICE", "Charge", "LeaseAsk", "Limiter", "estimate", "quota",
           "rate_limited"]

DEFAULT_MAX_TOKENS = 256  # a request without max_tokens is charged this many
SLICE = 20  # a lease is a twentieth of the limit (at least what the request needs)
REFUSAL_KEPT = 1.0  # seconds a refusal of the server is believed without asking again
MINUTE = 60.0


def estimate(body: Mapping[str, Any], body_bytes: int) -> int:
    m = body.get("max_tokens", body.get("max_completion_tokens"))
    out = m if type(m) is int and m >= 0 else DEFAULT_MAX_TOKENS
    return body_bytes // 4 + out


def rate_limited(key: str, what: str, limit: int, retry: float) -> ApiError:
    secs = max(1, math.ceil(retry))
    return ApiError(429, f"Rate limit reached for API key {key} on {what}: limit {limit}. "
                    f"Please try again in {secs}s.", type_="tokens" if "token" in what else "requests",
                    code="rate_limit_exceeded", retry_after=secs)


def _too_many(key: ApiKeyRecord) -> ApiError:
    """429 for a key running its concurrency (a slot frees when a request ends)."""
    return rate_limited(key.name, "concurrent requests", key.concurrency, 1)


def quota(key: str, detail: str, retry: float) -> ApiError:
    return ApiError(429, f"You exceeded the token budget of API key {key}: {detail}.",
                    type_="insufficient_quota", code="insufficient_quota",
                    retry_after=max(1, math.ceil(retry)))


class Charge:
    """What one admitted request took: settled (or rolled back) once."""

    __slots__ = ("gate", "tokens", "spent", "running")

    def __init__(self, gate: Gate, tokens: int, spent: tuple[tuple[Wallet, bool], ...] = (),
                 running: bool = False) -> None:
        self.gate = gate  # of its key
        self.tokens = tokens  # charged to tpm and budget wallets
        self.spent = spent  # (wallet, charged per token) of the wallets spent from
        self.running = running  # on a concurrency slot


class Limiter:
    def __init__(self, ask: LeaseAsk | None) -> None:
        self.gates: dict[str, Gate] = {}  # per key name: keys of the table only, bounded
        self.leases = Leases(ask, self.gates)
        self.lost_admits = 0  # requests admitted on a rate limit the server could not lease

    def applies(self, key: ApiKeyRecord) -> bool:
        return bool(key.rpm or key.tpm or key.concurrency or key.budget)

    def admit_now(self, key: ApiKeyRecord, tokens: int, now: float) -> Charge | None:
        """The usual case, without an await: a request of `key` charged `tokens` admitted
        on what this router holds (a slot, the wallets' leases). None when anything needs
        more (an ask, a refusal, an estimate over a limit, a key not seen yet): `admit`.
        Every request takes this path first."""
        gate = self.gates.get(key.name)
        if gate is None or gate.plan_key is not key or tokens > gate.plan_most:
            return None
        conc = key.concurrency
        if conc:
            sw = gate.slots
            if sw.running >= conc or not sw.start(now):
                return None
        spent = gate.plan_spent
        for w, per_token in spent:
            if not w.spend(tokens if per_token else 1, now):
                self._rollback(Charge(gate, tokens, spent[:spent.index((w, per_token))],
                                      bool(conc)))
                return None
        return Charge(gate, tokens, spent, bool(conc))

    async def admit(self, key: ApiKeyRecord, tokens: int) -> Charge:
        """Admit one request charged `tokens`, or raise ApiError (429, or 503 for a budget
        the server cannot be asked about)."""
        gate = self.gates.get(key.name)
        if gate is None:
            gate = self.gates[key.name] = Gate()
        if gate.plan_key is not key:
            self._plan(gate, key)
        charge = self.admit_now(key, tokens, trio.current_time())
        if charge is not None:
            return charge
        if key.tpm and tokens > key.tpm:
            raise rate_limited(key.name, "tokens per minute (one request's estimate alone, "
                               f"{tokens} tokens, is over it)", key.tpm, 60)
        if key.budget and tokens > key.budget.tokens:
            raise quota(key.name, f"one request's estimate ({tokens} tokens) is over the "
                        f"whole budget of {key.budget.tokens}", key.budget.period)
        charge = Charge(gate, tokens)
        if key.concurrency:
            if gate.slots.running >= key.concurrency:  # a limit lowered: at once here too
                raise _too_many(key)
            if not gate.slots.start(trio.current_time()):  # a slot held
                await self._slot(gate, key)
            charge.running = True
        try:
            for kind, w, per_token, limit in gate.plan:
                if await self._spend(gate, key, kind, w, tokens if per_token else 1, limit):
                    charge.spent += ((w, per_token),)
        except ApiError:
            self._rollback(charge)
            raise
        return charge

    def _plan(self, gate: Gate, key: ApiKeyRecord) -> None:
        """The wallets a request of `key` spends from, in order: rpm (one unit), tpm and
        the budget (its tokens); made again when the table brings another record."""
        plan = []
        for kind, per_token, limit in ((LimitKind.RPM, False, key.rpm),
                                       (LimitKind.TPM, True, key.tpm),
                                       (LimitKind.BUDGET, True,
                                        key.budget.tokens if key.budget else 0)):
            if limit:
                w = gate.wallets.get(kind)
                if w is None:  # kept across records: its leases are the router's
                    w = gate.wallets[kind] = Wallet(key.budget.period if kind is LimitKind.BUDGET
                                                    and key.budget else MINUTE)
                plan.append((kind, w, per_token, limit))
        gate.plan = tuple(plan)
        gate.plan_spent = tuple((w, per_token) for _, w, per_token, _ in plan)
        gate.plan_most = min((limit for _, _, per_token, limit in plan if per_token),
                             default=math.inf)
        gate.plan_key = key

    async def _slot(self, gate: Gate, key: ApiKeyRecord) -> None:
        """Start a request of `key` on a slot (asking the server for more), or as
        on_server_loss says while the server is away; else raise ApiError (429)."""
        sw = gate.slots
        kind = LimitKind.CONCURRENCY
        async with gate.lock(kind):
            now = trio.current_time()
            if sw.start(now):  # another request's ask brought some, or one ended
                return
            until, _ = gate.refused_until.get(kind, (0.0, 0.0))
            if now < until:
                raise _too_many(key)
            leases = self.leases
            if leases.ask is None or now < leases.no_slots_until:
                return self._alone(sw, key)
            if now < leases.lost_until:
                return self._slot_lost(sw, key)
            held = sw.held(now)
            want = min(key.concurrency, max(1, math.ceil(key.concurrency / SLICE))
                       + max(0, sw.running - held))
            try:
                got, sent = await leases.lease(key.name, kind, want, give_back=False)
            except (RequestFailedError, ProtocolError) as exc:  # a server from before slots
                leases.no_slots(exc)
                return self._alone(sw, key)
            except (LlmgwError, trio.TooSlowError, OSError) as exc:
                leases.server_lost(exc)
                return self._slot_lost(sw, key)
            leases.answered()
            if got.hold > 0 or got.declare:
                raise self._held(key, max(got.hold, 1.0))
            if got.units <= 0:
                wait = min(got.retry_after, REFUSAL_KEPT)
                gate.refused_until[kind] = (sent + wait, sent + wait)
                raise _too_many(key)
            leases.granted(got)
            sw.add(SlotLease(got.term, got.grant_id, got.units, sent + got.ttl))
            if not sw.start(trio.current_time()):
                raise _too_many(key)

    def _alone(self, sw: SlotWallet, key: ApiKeyRecord) -> None:
        """Counted on this router alone (no server to ask, or one from before slots)."""
        if sw.running >= max(key.concurrency, sw.held(trio.current_time())):
            raise _too_many(key)
        sw.started()

    def _slot_lost(self, sw: SlotWallet, key: ApiKeyRecord) -> None:
        """The server is unreachable and the slots held are taken: on_server_loss."""
        if key.on_server_loss == "deny":
            raise ApiError(503, f"The concurrency of API key {key.name} cannot be checked "
                           "while the control plane is unreachable; try again shortly.",
                           type_="server_error", code="limits_unavailable", retry_after=5)
        self._alone(sw, key)
        self.lost_admits += 1

    async def _spend(self, gate: Gate, key: ApiKeyRecord, kind: LimitKind, w: Wallet,
                     units: int, limit: int) -> bool:
        """True when spent from `kind`'s wallet `w` (asking for a lease when it runs low);
        False when admitted without one (server lost, a rate); raises ApiError when
        refused."""
        now = trio.current_time()
        if w.spend(units, now):
            return True
        async with gate.lock(kind):
            now = trio.current_time()
            if w.spend(units, now):  # another request's ask brought some
                return True
            until, free_at = gate.refused_until.get(kind, (0.0, 0.0))
            if now < until:
                raise self._refusal(key, kind, limit, free_at - now)
            leases = self.leases
            if leases.ask is None or now < leases.lost_until:
                return self._lost(key, kind, limit)
            leases.give_back_expired(now)
            want = max(units, math.ceil(limit / SLICE))
            try:
                got, sent = await leases.lease(key.name, kind, want)
            except (LlmgwError, trio.TooSlowError, OSError) as exc:
                leases.server_lost(exc)
                return self._lost(key, kind, limit)
            leases.answered()
            if got.hold > 0 or got.declare:  # still counting after waiting for it
                raise self._held(key, max(got.hold, 1.0))
            if got.units <= 0:
                gate.refused_until[kind] = (sent + min(got.retry_after, REFUSAL_KEPT),
                                            sent + got.retry_after)
                raise self._refusal(key, kind, limit, got.retry_after)
            leases.granted(got)
            w.add(Grant(got.grant_id, "", got.units, sent, sent + got.ttl, got.term))
            if w.spend(units, trio.current_time()):
                return True
            raise self._refusal(key, kind, limit, 1.0)  # fewer than the request needs

    async def keep_terms(self, every: float = PROBE_EVERY) -> None:
        """router/tenants/leases.py's probe of the leader and renewal of slots; runs until
        cancelled."""
        await self.leases.keep_terms(every)

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

    def settle(self, charge: Charge, used_tokens: int | None, now: float | None = None) -> None:
        """The request ended (at `now`, the clock's if None): its concurrency slot back,
        its token charge settled against `used_tokens` (None: unknown, the charge
        stands)."""
        if charge.running:
            charge.gate.slots.ended()
            charge.running = False
        tokens = charge.tokens
        if used_tokens is None or used_tokens == tokens:
            return
        if now is None:
            now = trio.current_time()
        for w, per_token in charge.spent:
            if per_token:
                if used_tokens < tokens:
                    w.refund(tokens - used_tokens, now)
                else:
                    w.spend(min(used_tokens - tokens, w.available(now)), now)

    def _rollback(self, charge: Charge) -> None:
        """A request refused by a later limit: what the earlier ones took goes back."""
        now = trio.current_time()
        for w, per_token in charge.spent:
            w.refund(charge.tokens if per_token else 1, now)
        charge.spent = ()
        if charge.running:
            charge.gate.slots.ended()
            charge.running = False
