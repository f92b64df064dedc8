"""Placement and reconcile cost over synthetic inventories. Prints figures; asserts nothing.

    .venv/bin/python bench/placement.py [--sizes 1000,10000,50000]

Each cluster: nodes of 8 NVSwitch H100s over 8 InfiniBand fabrics, 5% islands, a few
nodes holding the model. Reported per size:
- index: building the ClusterView from the snapshot (once per inventory change);
- place 1x8: one single-node replica (median of many, on a half-full cluster);
- place gang 2x8: one two-node replica in one fabric;
- unschedulable: a replica nobody fits (the full scan that explains why);
- reconcile, on one ReconcileState kept across passes as the server keeps it: the first
  pass (it builds the index and places one replica per 8 nodes); a steady-state pass
  (every replica ready, nothing dirty); a pass that places one more replica;
- apply 1000: a deployment of 1,000 single-GPU replicas applied to that cluster, passes
  run until every replica is placed (total).

--json FILE writes one object per size: {"50000": {"place_one_ms": ..., ...}, ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from attrs import evolve  # noqa: E402

from fakes.cluster import synthetic  # noqa: E402
from llmgw.model.deployment import Deployment, ReplicaState, Strategy  # noqa: E402
from llmgw.model.engine import EngineKind, EngineReport, EngineState  # noqa: E402
from llmgw.server.placement.place import ClusterView, Placement, place  # noqa: E402
from llmgw.server.reconcile.rules import NodeDelta, ReconcileState, reconcile_dirty  # noqa: E402


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    times = []
    out: object = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def ms(seconds: float) -> str:
    return f"{seconds * 1000:9.3f} ms"


def run(size: int) -> dict[str, float]:
    t = time.perf_counter()
    nodes = synthetic(size)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    view = ClusterView(nodes)
    index_s = time.perf_counter() - t

    def dep(gpus: int, n: int, model: str = "org/model", **kw: object) -> Deployment:
        return Deployment(
            name="bench", model=model, engine=EngineKind.VLLM, gpus_per_node=gpus,
            replicas=1, nodes=n, **kw,  # type: ignore[arg-type]
        )

    # Fill half the cluster with 4-GPU replicas (spread leaves every node half full).
    t = time.perf_counter()
    filled = 0
    for _ in range(size // 2):
        p = place(dep(4, 1, model="org/other", strategy=Strategy.SPREAD), view)
        if isinstance(p, Placement):
            view.reserve(p.members)
            filled += 1
    fill_s = time.perf_counter() - t

    one_s, _ = timed(lambda: place(dep(4, 1), view), 200)
    one_new_s, _ = timed(lambda: place(dep(4, 1, model="org/unseen"), view), 200)
    gang_s, gang = timed(lambda: place(dep(4, 2), view), 50)
    unsched_s, _ = timed(lambda: place(dep(9, 1), view), 5)

    # Steady-state reconcile: one ready 8-GPU replica per 8 nodes, on one ReconcileState
    # kept across passes as the server keeps it (deltas in, dirty marks).
    d = Deployment(name="bench", model="org/model", engine=EngineKind.VLLM, gpus_per_node=8,
                   replicas=size // 8)
    deps = {"bench": d}
    state = ReconcileState(nodes)
    state.deployment_changed("bench")
    t = time.perf_counter()
    res = reconcile_dirty(state, deps, 0.0)
    first_s = time.perf_counter() - t
    reports: dict[str, list[EngineReport]] = {}
    for r in res.replicas.values():
        for m in r.members:
            reports.setdefault(m.node_id, []).append(
                EngineReport(r.id, r.generation, EngineState.READY)
            )
    for nid, rs in reports.items():
        state.node(NodeDelta(nid, nodes[nid], tuple(rs)))
    res = reconcile_dirty(state, deps, 1.0, generation_floor=res.generation_floor)
    ready = sum(1 for r in res.replicas.values() if r.state == ReplicaState.READY)
    steady_s, _ = timed(lambda: reconcile_dirty(state, deps, 2.0, generation_floor=res.generation_floor), 200)

    def scale_up() -> None:
        nonlocal res
        deps["bench"] = evolve(deps["bench"], replicas=deps["bench"].replicas + 1)
        state.deployment_changed("bench")
        res = reconcile_dirty(state, deps, 2.0, generation_floor=res.generation_floor)

    scale_s, _ = timed(scale_up, 5)

    deps["apply"] = Deployment(name="apply", model="org/apply", engine=d.engine, gpus_per_node=1,
                               replicas=1000)
    t = time.perf_counter()
    state.deployment_changed("apply")
    passes = 0
    while len([r for r in res.replicas.values() if r.deployment == "apply" and r.placed]) < 1000:
        res = reconcile_dirty(state, deps, 3.0 + passes, generation_floor=res.generation_floor)
        passes += 1
    apply_s = time.perf_counter() - t

    print(f"{size:>6} nodes ({size * 8} GPUs)")
    print(f"  synthetic inventory    {ms(build_s)}")
    print(f"  index (ClusterView)    {ms(index_s)}")
    print(f"  fill {filled} replicas   {ms(fill_s)}  ({ms(fill_s / max(1, filled))} each)")
    print(f"  place 1x4, weights held{ms(one_s)}")
    print(f"  place 1x4, no weights  {ms(one_new_s)}")
    ok = "ok" if isinstance(gang, Placement) else "unschedulable"
    print(f"  place gang 2x4         {ms(gang_s)}  ({ok})")
    print(f"  unschedulable 1x9      {ms(unsched_s)}  (full scan with reasons)")
    print(f"  first pass             {ms(first_s)}  (indexes the cluster, places {size // 8})")
    print(f"  reconcile pass         {ms(steady_s)}  ({ready} ready replicas, nothing to do)")
    print(f"  reconcile, scale +1    {ms(scale_s)}  (places one on the index kept)")
    print(f"  apply 1000x1 replicas  {ms(apply_s)}  ({passes} passes, all placed)")
    return {"place_one_ms": one_s * 1000, "place_gang_ms": gang_s * 1000,
            "pass_idle_ms": steady_s * 1000, "pass_place_one_ms": scale_s * 1000,
            "apply_1000_ms": apply_s * 1000}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000,50000")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here, as JSON")
    args = ap.parse_args()
    figures = {}
    for size in (int(s) for s in args.sizes.split(",")):
        figures[str(size)] = run(size)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
