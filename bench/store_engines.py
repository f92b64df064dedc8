"""The store on SQLite beside PostgreSQL (issue 14): a ctl apply's writes (put_deployment
+ add_events) and a reconcile pass's save_replicas, median and p99 in milliseconds.

    python bench/store_engines.py [--replicas 1000] [--n 200] [--pg-url postgresql://...]

Without --pg-url it starts a throwaway PostgreSQL (tests/fakes/postgres.py). Both on this
machine's disk, PostgreSQL over 127.0.0.1 with fsync as the test cluster sets it (off:
compare the round trips, not the disks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from attrs import evolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakes.cluster import cluster, node  # noqa: E402
from llmgw.model.deployment import Deployment  # noqa: E402
from llmgw.model.engine import EngineKind  # noqa: E402
from llmgw.server.reconcile.rules import reconcile  # noqa: E402
from llmgw.server.store.sql import SqlStore, Store, StoredEvent  # noqa: E402


def figures(store: SqlStore, replicas: int, n: int) -> dict[str, float]:
    d = Deployment(name="d", model="org/m", engine=EngineKind.SIMULATED, gpus_per_node=1,
                   replicas=replicas)
    c = cluster(*[node(f"n{i}") for i in range(replicas // 8 + 1)])
    reps = reconcile({"d": d}, {}, c, {}, 1.0).replicas
    apply, passes = [], []
    for i in range(n):
        t = time.perf_counter()
        store.put_deployment(evolve(d, replicas=replicas + i % 2), float(i))
        store.add_events([StoredEvent(float(i), "d", "", "updated")])
        apply.append(time.perf_counter() - t)
        # A pass that changed one replica (the usual), and the whole set compared.
        rid = sorted(reps)[i % len(reps)]
        reps = {**reps, rid: evolve(reps[rid], generation=reps[rid].generation + 1)}
        t = time.perf_counter()
        store.save_replicas(reps, events=[StoredEvent(float(i), "d", rid, "moved")], generation_floor=i)
        passes.append(time.perf_counter() - t)

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1000

    return {"apply_p50_ms": statistics.median(apply) * 1000, "apply_p99_ms": q(apply, 0.99),
            "pass_store_p50_ms": statistics.median(passes) * 1000, "pass_store_p99_ms": q(passes, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=1000)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--pg-url", default="")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Store(str(Path(tmp) / "state.db")) as s:
        print("sqlite    ", {k: round(v, 2) for k, v in figures(s, a.replicas, a.n).items()})
    from fakes.postgres import PgServer, pg_bin
    from llmgw.server.store.postgres import PgStore

    server = None
    url = a.pg_url
    if not url:
        bin_dir = pg_bin()
        if bin_dir is None:
            sys.exit("no PostgreSQL: apt-get install postgresql, or give --pg-url")
        server = PgServer(bin_dir)
        url = server.new_database()
    try:
        with PgStore(url) as p:
            print("postgres  ", {k: round(v, 2) for k, v in figures(p, a.replicas, a.n).items()})
            lease = p.lease_connection()
            e = lease.acquire("bench", "tcp://x:1", 10.0)
            p.fence = (e or 0, "bench")
            print("pg fenced ", {k: round(v, 2) for k, v in figures(p, a.replicas, a.n).items()})
            lease.close()
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
