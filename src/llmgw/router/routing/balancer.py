"""Choosing a replica: pure data structures, time passed in, no I/O.

- Least outstanding with power-of-two choices: two distinct eligible replicas are drawn
  at random and the less loaded wins. Load is the router's own in-flight count (counted
  at dispatch, released when the response ends) plus the engine's queue from /metrics.
  Engine figures older than `stale_after` (or never seen) are left out: the in-flight
  count alone then says how loaded a replica is (an engine whose /metrics stalls under
  load is busy, not full).
- Prefix affinity: bounded-load consistent hashing. Each replica owns `VNODES` points on
  a hash ring; a request's key (the start of its prompt) hashes to a point and walks
  clockwise to the first eligible replica whose in-flight count stays within
  `ceil(BOUND * (total + 1) / n)`. Memory is the ring: `VNODES` points per replica, no
  per-prefix state.
- Ejection needs evidence: a replica is skipped until `ejected_until` only after
  `eject_after` failures in a row while another replica of the model answered (a success
  since its first failure of the run), and never when it is the last one not ejected. A
  burst in which every replica fails at once (the router's own trouble, most likely)
  ejects none. When every ready replica is ejected all the same, the least bad one (the
  one whose cool-off ends first) is still tried rather than answering 503 for the cool-off.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random

VNODES = 40
BOUND = 1.25
KV_FULL_PENALTY = 8.0


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Replica:
    """One engine endpoint with the router's view of its load. Mutable, identity-stable."""

    __slots__ = (
        "replica_id",
        "url",
        "host",
        "port",
        "authority",
        "ready",
        "outstanding",
        "ejected_until",
        "running",
        "waiting",
        "kv_usage",
        "load_at",
        "fails",
        "fail_since",
        "last_ok",
        "auth",
        "prefix_cache",
    )

    def __init__(self, replica_id: str, url: str, ready: bool = True) -> None:
        self.replica_id = replica_id
        self.ready = ready
        self.outstanding = 0
        self.ejected_until = 0.0
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.load_at = -math.inf
        self.fails = 0  # failures in a row (a success resets it)
        self.fail_since = 0.0  # when the first of them came
        self.last_ok = -math.inf  # when it last answered (a response head that was no 5xx)
        self.url = ""
        self.host = ""
        self.port = 0
        self.authority = b""
        # The header line that carries the engine's own key upstream (engine API keys), set
        # from the endpoint table (router/routing/table.py); b"": the engine has none.
        self.auth = b""
        # The engine's own prefix-cache counters (hit tokens, queried tokens) as its
        # /metrics last gave them (routing/loadwatch.py); None: it gives none.
        self.prefix_cache: tuple[float, float] | None = None
        self.set_url(url)

    def set_url(self, url: str) -> None:
        self.url = url
        rest = url.split("://", 1)[-1].split("/", 1)[0]
        host, _, port = rest.rpartition(":")
        if not host:
            host, port = rest, "80"
        self.host = host.strip("[]")
        self.port = int(port)
        self.authority = f"{host}:{port}".encode()

    def set_load(self, running: float, waiting: float, kv_usage: float, now: float) -> None:
        self.running = running
        self.waiting = waiting
        self.kv_usage = kv_usage
        self.load_at = now

    def score(self, now: float, stale_after: float) -> float:
        """Lower is better: in-flight count plus what the engine queues."""
        if now - self.load_at > stale_after:
            return float(self.outstanding)
        # The engine's waiting queue and a nearly full KV cache both mean a new request waits.
        return self.outstanding + self.waiting + (KV_FULL_PENALTY if self.kv_usage >= 0.95 else 0.0)

    def eligible(self, now: float) -> bool:
        return self.ready and now >= self.ejected_until

    def __repr__(self) -> str:
        return f"Replica({self.replica_id!r}, {self.url!r}, out={self.outstanding})"


class Pool:
    """The replicas serving one model, with the chosen policy."""

    __slots__ = ("replicas", "affinity", "prefix_chars", "n_ready", "_ring_keys", "_ring_owners", "_rng")

    def __init__(
        self,
        replicas: list[Replica],
        *,
        affinity: bool = False,
        prefix_chars: int = 256,
        rng: random.Random | None = None,
    ) -> None:
        self.replicas = replicas
        self.affinity = affinity
        self.prefix_chars = prefix_chars
        self.n_ready = sum(1 for r in replicas if r.ready)  # admission's capacity counts these
        self._rng = rng or random.Random()
        self._ring_keys: list[int] = []
        self._ring_owners: list[Replica] = []
        if affinity:
            self._build_ring()

    def _build_ring(self) -> None:
        points: list[tuple[int, Replica]] = []
        for r in self.replicas:
            base = r.replica_id.encode()
            for i in range(VNODES):
                points.append((_hash64(base + b"#" + str(i).encode()), r))
        points.sort(key=lambda p: p[0])
        self._ring_keys = [p[0] for p in points]
        self._ring_owners = [p[1] for p in points]

    def any_ready(self) -> bool:
        for r in self.replicas:  # a plain loop: no generator per request
            if r.ready:
                return True
        return False

    def choose(
        self,
        now: float,
        stale_after: float,
        key: str | None = None,
        exclude: tuple[Replica, ...] = (),
    ) -> Replica | None:
        """The replica for the next request, or None when no ready one is left."""
        cands = [r for r in self.replicas if r.eligible(now) and r not in exclude]
        if not cands:
            # Every ready replica is ejected: the least bad one (its cool-off ends first)
            # is tried all the same, rather than a 503 for the whole cool-off.
            best: Replica | None = None
            for r in self.replicas:
                if r.ready and r not in exclude and (best is None or r.ejected_until < best.ejected_until):
                    best = r
            return best
        if len(cands) == 1:
            return cands[0]
        if self.affinity and key is not None and self._ring_keys:
            chosen = self._by_affinity(key, cands, now, stale_after)
            if chosen is not None:
                return chosen
        # Two distinct candidates at random (random.sample costs more than this).
        n = len(cands)
        rand = self._rng.random
        i = int(rand() * n)
        j = int(rand() * (n - 1))
        a = cands[i]
        b = cands[j + 1 if j >= i else j]
        return a if a.score(now, stale_after) <= b.score(now, stale_after) else b

    def note_failure(self, r: Replica, now: float, eject_after: int) -> bool:
        """Count a failure of `r`; True when it should be ejected now: `eject_after`
        failures in a row, another replica of this pool answered since the first of them,
        and that one is not ejected (so the last replica standing never is)."""
        if r.fails == 0:
            r.fail_since = now
        r.fails += 1
        if r.fails < eject_after:
            return False
        since = r.fail_since
        for o in self.replicas:
            if o is not r and o.ready and now >= o.ejected_until and o.last_ok >= since:
                return True
        return False

    def _by_affinity(self, key: str, cands: list[Replica], now: float, stale_after: float) -> Replica | None:
        total = sum(r.outstanding for r in cands)
        limit = math.ceil(BOUND * (total + 1) / len(cands))
        h = _hash64(key[: self.prefix_chars].encode("utf-8", "surrogatepass"))
        keys = self._ring_keys
        owners = self._ring_owners
        n = len(keys)
        start = bisect.bisect_left(keys, h)
        seen: set[int] = set()
        for i in range(n):
            r = owners[(start + i) % n]
            if id(r) in seen:
                continue
            seen.add(id(r))
            if r in cands and r.outstanding + 1 <= limit:
                return r
            if len(seen) == len(self.replicas):
                break
        return None


def prefix_key(body: dict[str, object], prefix_chars: int) -> str | None:
    """The start of the prompt: `prompt` for completions, message contents for chat."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:prefix_chars]
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first[:prefix_chars]
        # Token ids (a list of ints) or anything else a client sent: its repr, bounded.
        return repr(first[:prefix_chars] if isinstance(first, list) else first)[:prefix_chars]
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for m in messages:
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            text = c if isinstance(c, str) else repr(c)
            parts.append(text)
            size += len(text)
            if size >= prefix_chars:
                break
        return "\x00".join(parts)[:prefix_chars]
    return None
