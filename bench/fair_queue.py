"""Two tenants through the fair queue (llmgw.router.routing.fairqueue), simulated time.

    .venv/bin/python bench/fair_queue.py [--seconds 600] [--seed 1]

One model with `--slots` engine slots, each request holding one for an exponential
service time (mean `--service` s). A batch tenant floods (Poisson, `--flood` × the
service rate), an interactive tenant sends at a low rate (Poisson, `--rate` per second).
The queue is driven as the router's admission drives one: a request takes a free slot
at once when nobody waits, else waits; a freed slot goes to the queue's next; `expire`
before every `pop`. Three ways, same arrivals and service times:

- fifo: one band, one key (today's admission: first come, first served);
- fair: one band, a key per tenant (round-robin across keys);
- classes: the interactive tenant in a band above the batch one, and keys.

Prints, per way and tenant, requests served, refused (queue full), shed (ttl) and
displaced, and the queue wait p50/p99 of the served ones (0 for one that found a slot).
"""

from __future__ import annotations

import argparse
import heapq
import random

from llmgw.router.routing.fairqueue import Band, Entry, FairQueue

INTERACTIVE = Band("interactive", 10, 30.0)
BATCH = Band("batch", 0, 120.0)
ONE = Band("all", 0, 120.0)


def arrivals(seconds: float, rate: float, flood: float, rng: random.Random) -> list[tuple[float, str]]:
    """(time, tenant) for both tenants, in time order."""
    out = []
    for tenant, lam in (("interactive", rate), ("batch", flood)):
        t = rng.expovariate(lam)
        while t < seconds:
            out.append((t, tenant))
            t += rng.expovariate(lam)
    out.sort()
    return out


class Tally:
    def __init__(self) -> None:
        self.served = self.refused = self.shed = self.displaced = 0
        self.waits: list[float] = []


def run(way: str, reqs: list[tuple[float, str, float]], slots: int, size: int) -> dict[str, Tally]:
    bands = [ONE] if way != "classes" else [INTERACTIVE, BATCH]
    q: FairQueue[int] = FairQueue(bands, size)
    stats = {t: Tally() for t in ("interactive", "batch")}
    events: list[tuple[float, int, int]] = []  # (time, 0 = a slot frees | 1 = arrival, index)
    for i, (t, _, _) in enumerate(reqs):
        heapq.heappush(events, (t, 1, i))
    active = 0

    def start(i: int, now: float) -> None:
        nonlocal active
        active += 1
        t, tenant, service = reqs[i]
        stats[tenant].served += 1
        stats[tenant].waits.append(now - t)
        heapq.heappush(events, (now + service, 0, i))

    def shed(now: float) -> None:
        for e, why in q.expire(now):
            tally = stats[reqs[e.item][1]]
            if why.why == "displaced":
                tally.displaced += 1
            else:
                tally.shed += 1

    while events:
        now, kind, i = heapq.heappop(events)
        shed(now)
        if kind == 0:
            active -= 1
            nxt = q.pop()
            if nxt is not None:
                start(nxt.item, now)
            continue
        tenant = reqs[i][1]
        if active < slots and not len(q):
            start(i, now)
            continue
        band = ONE if way != "classes" else (INTERACTIVE if tenant == "interactive" else BATCH)
        key = "one" if way == "fifo" else tenant
        if not isinstance(q.push(i, band, key, now), Entry):
            stats[tenant].refused += 1
        shed(now)
    return stats


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--service", type=float, default=1.0, help="mean service time, s")
    ap.add_argument("--rate", type=float, default=0.5, help="interactive requests per second")
    ap.add_argument("--flood", type=float, default=1.5, help="batch load, × the service rate")
    ap.add_argument("--queue", type=int, default=256, help="how many may wait")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    base = arrivals(a.seconds, a.rate, a.flood * a.slots / a.service, rng)
    reqs = [(t, tenant, rng.expovariate(1 / a.service)) for t, tenant in base]
    print(f"{a.slots} slots, mean service {a.service:g}s, interactive {a.rate:g}/s, batch "
          f"{a.flood:g}x capacity, queue {a.queue}, {a.seconds:g}s simulated, seed {a.seed}; "
          f"ttl {INTERACTIVE.ttl:g}s interactive / {BATCH.ttl:g}s batch (one band: {ONE.ttl:g}s)")
    print(f"{'way':8} {'tenant':12} {'served':>7} {'refused':>8} {'shed':>6} {'displ.':>7} "
          f"{'wait p50':>9} {'wait p99':>9}")
    for way in ("fifo", "fair", "classes"):
        for tenant, s in run(way, reqs, a.slots, a.queue).items():
            print(f"{way:8} {tenant:12} {s.served:7d} {s.refused:8d} {s.shed:6d} "
                  f"{s.displaced:7d} {pct(s.waits, 50):8.3f}s {pct(s.waits, 99):8.3f}s")


if __name__ == "__main__":
    main()
