"""The endpoint table: versioned snapshots from the server → one Pool per served model.

A new snapshot keeps the Replica objects of replicas it still lists (same replica_id), so
in-flight counts, ejections and engine load carry over; a replica that left is dropped
(requests still running on it release their count on the orphaned object, harmlessly).
Pure: no trio, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from llmgw.router.balancer import Pool, Replica


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
        self._rng = rng or random.Random()

    def apply(self, snapshot: Mapping[str, Any]) -> bool:
        """Take a snapshot {"version", "models": {name: [{replica_id, url, ready}]}}.

        Returns False (and changes nothing) when the version is not newer."""
        version = int(snapshot.get("version", 0))
        if version == self.version:
            return False
        models = snapshot.get("models") or {}
        old = self.replicas
        replicas: dict[str, Replica] = {}
        pools: dict[str, Pool] = {}
        for name, entries in models.items():
            members: list[Replica] = []
            for e in entries:
                rid = str(e["replica_id"])
                url = str(e["url"]).rstrip("/")
                ready = bool(e.get("ready", True))
                r = replicas.get(rid) or old.get(rid)
                if r is None:
                    r = Replica(rid, url, ready)
                else:
                    if r.url != url:
                        r.set_url(url)
                    r.ready = ready
                replicas[rid] = r
                members.append(r)
            affinity, prefix_chars = self.policies.get(name, (False, 256))
            pools[str(name)] = Pool(members, affinity=affinity, prefix_chars=prefix_chars, rng=self._rng)
        self.replicas = replicas
        self.pools = pools
        self.version = version
        return True

    def ready_models(self) -> list[str]:
        return sorted(name for name, pool in self.pools.items() if pool.any_ready())
