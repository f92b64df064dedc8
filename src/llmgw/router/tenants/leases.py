"""The router's lease conversation with the leader (API keys and limits), for router/tenants/limits.py's
admission: the asks (a lease's slice, or nothing), the leader's term, a new term's hold and
the declarations it waits for, the renewal of concurrency slots, the give-back of what ran
out, and whether the server is reachable (server/tenants/limits.py is the other end).

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
which also gives back what ran out); it costs nothing otherwise. It renews the slots held
first, once a second, giving back what was not used in that second.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio
from attrs import define, field

from llmgw.errors import LlmgwError
from llmgw.model.apikey import ApiKeyRecord
from llmgw.router.tenants.slots import SlotWallet
from llmgw.router.tenants.wallet import Wallet
from llmgw.transport.apikey_ops import MAX_HELD, NO_TERM, Held, LeaseOp, LeaseResult, LimitKind, Unused
from llmgw.transport.codec import structure_result

log = logging.getLogger("llmgw.router.tenants.limits")  # the limits' log, as before the split

LeaseAsk = Callable[[LeaseOp], Awaitable[Mapping[str, Any] | None]]
LOST_FOR = 2.0  # seconds without asks after the server did not answer
PROBE_EVERY = 1.0  # seconds between asks for nothing while the router holds grants
HOLD_WAIT = 3.0  # seconds a request waits at most for a new term's hold (server/tenants/limits.py HOLD)
NO_SLOTS_FOR = 60.0  # seconds a server that refused the slots' kind is not asked again


@define
class Gate:
    """What the router holds of one key: its wallets and slots (declared, renewed and
    given back here), and admission's refusals and one-ask-at-a-time locks."""
    wallets: dict[LimitKind, Wallet] = field(factory=dict)
    # Until when a refusal is believed, and when the server said units are free again.
    refused_until: dict[LimitKind, tuple[float, float]] = field(factory=dict)
    locks: dict[LimitKind, trio.Lock] = field(factory=dict)
    slots: SlotWallet = field(factory=SlotWallet)
    # Admission's plan for the key record it was made for (router/tenants/limits.py `_plan`): per
    # limit (kind, wallet, charged per token, limit), and (wallet, per token) alone.
    plan_key: ApiKeyRecord | None = None
    plan: tuple[tuple[LimitKind, Wallet, bool, int], ...] = ()
    plan_spent: tuple[tuple[Wallet, bool], ...] = ()
    plan_most: float = math.inf  # the most tokens one request may be charged

    def lock(self, kind: LimitKind) -> trio.Lock:
        """The lock of `kind`'s asks: one at a time per key and limit."""
        lock = self.locks.get(kind)
        if lock is None:
            lock = self.locks[kind] = trio.Lock()
        return lock


class Leases:
    def __init__(self, ask: LeaseAsk | None, gates: Mapping[str, Gate]) -> None:
        self.ask = ask
        self.gates = gates  # the limiter's, per key name
        self.unused: list[Unused] = []  # lease units to give back on the next ask
        self.lost_until = -math.inf
        self._lost_logged = False
        self.term = NO_TERM  # the leader's term last heard of (server/tenants/limits.py)
        self.declared = 0  # grants declared to leaders of new terms, for the log and tests
        self._redeclare = False  # a grant of an old term came after the new one's
        self._hold_logged = ""
        self.hold_until = -math.inf  # a new term's hold: asks wait until then
        self.no_slots_until = -math.inf  # a server from before slots: counted alone until
        self._no_slots_logged = False

    def server_lost(self, exc: BaseException) -> None:
        if not self._lost_logged:
            log.warning("cannot ask the server for leases (%s): rate limits admit, budgets "
                        "refuse, concurrency admits up to each key's on this router alone, "
                        "until it answers", exc)
            self._lost_logged = True
        self.lost_until = trio.current_time() + LOST_FOR

    def answered(self) -> None:
        """The server answered an ask (after it was lost, says so once)."""
        if self._lost_logged:
            log.info("the server grants leases again")
            self._lost_logged = False

    def no_slots(self, exc: BaseException) -> None:
        """The server refused the slots' kind: one from before slots."""
        if not self._no_slots_logged:
            log.warning("the server does not lease concurrency slots (%s): each "
                        "router counts a key's concurrency alone", exc)
            self._no_slots_logged = True
        self.no_slots_until = trio.current_time() + NO_SLOTS_FOR

    def granted(self, got: LeaseResult) -> None:
        """A grant came: note its term."""
        if got.term and self.term not in (got.term, NO_TERM):
            self._redeclare = True  # granted by an old term after we heard of the new
        elif got.term:
            self.term = got.term

    async def lease(self, name: str, kind: LimitKind, want: int,
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
                    self.give_back_expired(now)
                    got = await self._ask(LeaseOp(first[0], first[1], 0, tuple(self.unused),
                                                  self.term))
                    if got.declare:
                        self._redeclare = True
                if self._redeclare:
                    await self._declare()
            except (LlmgwError, trio.TooSlowError, OSError) as exc:
                # The asks of requests log a lost server; a server from before slots
                # refuses their renewals, and they lapse.
                log.debug("lease probe: %s", exc)

    def give_back_expired(self, now: float) -> None:
        for name, gate in self.gates.items():
            for kind, w in gate.wallets.items():
                for g, left in w.ended(now):
                    if g.id and left:
                        self.unused.append(Unused(name, kind, g.id, left, g.term))
        del self.unused[4000:]  # bounded; what is not given back frees at its lease's end
