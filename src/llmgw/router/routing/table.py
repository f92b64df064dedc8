"""The endpoint table: versioned snapshots from the server → one Pool per served model.

An entry's `adapters` (the LoRA adapters its engine has loaded) put the same Replica in a
Pool of each adapter's name too, so that a request whose `model` is an adapter goes only
where it is loaded, sharing the replica's in-flight count with its base. A served name
wins over an adapter of the same name (the server refuses such a deployment anyway).

A new snapshot keeps the Replica objects of replicas it still lists (same replica_id), so
in-flight counts, ejections and engine load carry over; a replica that left is dropped
(requests still running on it release their count on the orphaned object, harmlessly).
Pure: no trio, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from llmgw.router.routing.balancer import Pool, Replica
from llmgw.transport.codec import structure_result
from llmgw.transport.requests import Endpoint, EndpointsResult


def auth_line(key: str) -> bytes:
    """The header line a request to an engine with `key` carries; b"" for none. The key
    was checked on arrival (Endpoint's validator): header-safe characters only."""
    return b"authorization: Bearer %s\r\n" % key.encode("ascii") if key else b""


class EndpointTable:
    def __init__(
        self,
        policies: Mapping[str, tuple[bool, int]] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        # served name → (prefix affinity?, prefix_chars)
        self.policies = dict(policies or {})
        self.version = -1
        self.pools: dict[str, Pool] = {}
        self.replicas: dict[str, Replica] = {}
        # Served name -> why nothing of it is ready (deployed, not serving yet).
        self.waiting: dict[str, str] = {}
        # Adapter name -> the served name of its base.
        self.bases: dict[str, str] = {}
        # Served names scaled to zero (or waking): their requests are held, not refused.
        self.cold: frozenset[str] = frozenset()
        # Served name -> its rows as the snapshot gave them (kv_aware reads their `kv`).
        self.rows: Mapping[str, tuple[Endpoint, ...]] = {}
        # Replicas whose engine schedules by the body's `priority` (routing/priority.py).
        self.priority: frozenset[str] = frozenset()
        self._rng = rng or random.Random()

    def apply(self, snapshot: Mapping[str, Any] | EndpointsResult) -> bool:
        """Take a snapshot {"version", "models": {name: [{replica_id, url, ready, key}]},
        "waiting": {name: why none is ready}}, parsed here (it comes from a peer: a
        malformed one raises ProtocolError and changes nothing).

        Returns False (and changes nothing) when the version is not newer."""
        snap = snapshot if isinstance(snapshot, EndpointsResult) else structure_result(
            snapshot, EndpointsResult)
        if snap.version == self.version:
            return False
        old = self.replicas
        replicas: dict[str, Replica] = {}
        pools: dict[str, Pool] = {}
        loaded: dict[str, list[Replica]] = {}  # adapter -> replicas that have it
        bases: dict[str, str] = {}
        priority: set[str] = set()
        for name, entries in snap.models.items():
            members: list[Replica] = []
            for e in entries:
                url = e.url.rstrip("/")
                r = replicas.get(e.replica_id) or old.get(e.replica_id)
                if r is None:
                    r = Replica(e.replica_id, url, e.ready)
                else:
                    if r.url != url:
                        r.set_url(url)
                    r.ready = e.ready
                r.auth = auth_line(e.key)
                if e.priority:
                    priority.add(e.replica_id)
                replicas[e.replica_id] = r
                members.append(r)
                for adapter in e.adapters:
                    if adapter not in snap.models and bases.setdefault(adapter, name) == name:
                        loaded.setdefault(adapter, []).append(r)
            affinity, prefix_chars = self.policies.get(name, (False, 256))
            pools[name] = Pool(members, affinity=affinity, prefix_chars=prefix_chars, rng=self._rng)
        for adapter, members in loaded.items():
            # The base's policy: an adapter's prompts share prefixes as its base's do.
            base_policy = self.policies.get(bases[adapter], (False, 256))
            affinity, prefix_chars = self.policies.get(adapter, base_policy)
            pools[adapter] = Pool(members, affinity=affinity, prefix_chars=prefix_chars, rng=self._rng)
        self.replicas = replicas
        self.pools = pools
        self.bases = bases
        self.waiting = dict(snap.waiting)
        self.cold = frozenset(snap.cold)
        self.rows = snap.models
        self.priority = frozenset(priority)
        self.version = snap.version
        return True

    def ready_models(self) -> list[str]:
        return sorted(name for name, pool in self.pools.items() if pool.any_ready())
