"""The placement index kept by deltas equals one built from scratch (hypothesis).

Whatever sequence of node changes (new, changed, gone), placements reserved, arbitrary
members reserved (on known nodes or not) and reservations released, the incremental
ClusterView's content equals that of a ClusterView built over the same nodes with the
same reservations, and placement answers the same way on both: placeable or not, and
when not, with the same reasons. The same holds one level up for ReconcileState (its
replica maps, timers and silent nodes) fed node deltas and replica changes.
"""

from __future__ import annotations

from typing import Any

from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st
from test_placement_props import deployments, node_views

from llmgw.model.deployment import Deployment, Member, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.server.placement.place import ClusterView, NodeView, Placement, Unschedulable, place
from llmgw.server.reconcile.state import NodeDelta, ReconcileState

IDS = ("n0", "n1", "n2", "n3", "n4")


@st.composite
def views(draw: st.DrawFn) -> tuple[str, NodeView]:
    nid = draw(st.sampled_from(IDS))
    v = draw(node_views(nid))
    lo = v.info.port_range[0]
    return nid, evolve(
        v,
        used_ports=frozenset(draw(st.sets(st.integers(lo, lo + 5), max_size=2))),
        blocked_ports=frozenset(draw(st.sets(st.integers(lo - 1, lo + 5), max_size=2))),
        draining=draw(st.booleans()) and draw(st.booleans()),
    )


@st.composite
def members(draw: st.DrawFn) -> tuple[Member, ...]:
    """Members of a made-up replica: GPUs and ports that may or may not exist there."""
    out = []
    for rank in range(draw(st.integers(1, 2))):
        nid = draw(st.sampled_from(IDS + ("unknown",)))
        gpus = draw(st.sets(st.integers(0, 8), max_size=3))
        out.append(Member(node_id=nid, rank=rank, gpus=tuple(f"GPU-{nid}-{i}" for i in sorted(gpus)),
                          port=draw(st.integers(20000, 20006)), addr="",
                          rendezvous_port=draw(st.sampled_from([0, 20007]))))
    return tuple(out)


OPS = st.one_of(
    st.tuples(st.just("node"), views()),
    st.tuples(st.just("gone"), st.sampled_from(IDS)),
    st.tuples(st.just("place"), deployments()),
    st.tuples(st.just("reserve"), members()),
    st.tuples(st.just("release"), st.integers(0, 20)),
)


def fresh(nodes: dict[str, NodeView], held: list[tuple[Member, ...]]) -> ClusterView:
    view = ClusterView(nodes)
    for ms in held:
        view.reserve(ms)
    return view


def answer(result: Placement | Unschedulable) -> Any:
    return True if isinstance(result, Placement) else result.reason


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=30))
def test_index_by_deltas_equals_index_from_scratch(ops: list[tuple[str, Any]]) -> None:
    nodes: dict[str, NodeView] = {}
    held: list[tuple[Member, ...]] = []
    view = ClusterView()
    for op, arg in ops:
        if op == "node":
            nid, v = arg
            v = evolve(v, info=evolve(v.info, node_id=nid))
            nodes[nid] = v
            view.update_node(nid, v)
        elif op == "gone":
            nodes.pop(arg, None)
            view.update_node(arg, None)
        elif op == "place":
            scratch = fresh(nodes, held)
            result = place(arg, view)
            assert answer(result) == answer(place(arg, scratch))
            if isinstance(result, Placement):
                view.reserve(result.members)
                held.append(result.members)
        elif op == "reserve":
            view.reserve(arg)
            held.append(arg)
        elif op == "release" and held:
            ms = held.pop(arg % len(held))
            view.release(ms)
        assert view.content() == fresh(nodes, held).content()


def replica(rid: str, ms: tuple[Member, ...], state: ReplicaState, restarts: int) -> Replica:
    d = Deployment(name=rid.split("-")[0], model="org/m", engine=EngineKind.VLLM, gpus_per_node=1,
                   replicas=1)
    return Replica(id=rid, deployment=d.name, index=int(rid.split("-")[1]), spec=d, generation=restarts,
                   members=ms if state != ReplicaState.PENDING else (), state=state,
                   restarts=restarts, backoff_until=100.0 + restarts, ready_since=50.0)


STATE_OPS = st.one_of(
    st.tuples(st.just("node"), views(), st.sampled_from([(), ("x-0",), ("x-0", "y-1")])),
    st.tuples(st.just("gone"), st.sampled_from(IDS)),
    st.tuples(st.just("replica"), st.sampled_from(["x-0", "x-1", "y-1"]), members(),
              st.sampled_from(list(ReplicaState)), st.integers(0, 2)),
    st.tuples(st.just("index"),),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(STATE_OPS, max_size=25))
def test_reconcile_state_by_deltas_equals_state_from_scratch(ops: list[tuple[Any, ...]]) -> None:
    state = ReconcileState()
    nodes: dict[str, NodeView] = {}
    reports: dict[str, tuple[EngineReport, ...]] = {}
    replicas: dict[str, Replica] = {}
    for op, *args in ops:
        if op == "node":
            (nid, v), rids = args
            v = evolve(v, info=evolve(v.info, node_id=nid))
            nodes[nid] = v
            reports[nid] = tuple(EngineReport(rid, 1, EngineState.READY) for rid in rids)
            state.node(NodeDelta(nid, v, reports[nid]))
        elif op == "gone":
            nodes.pop(args[0], None)
            reports.pop(args[0], None)
            state.node(NodeDelta(args[0], None))
        elif op == "replica":
            rid, ms, st_, restarts = args
            replicas[rid] = replica(rid, ms, st_, restarts)
            state.put_replicas({rid: replicas[rid]})
        else:
            state.view(replicas)
    scratch = ReconcileState(nodes, replicas, reports)
    for attr in ("nodes", "reports", "silent", "draining", "sick", "replicas", "on_node", "of_deployment", "unplaced",
                 "timed"):
        assert getattr(state, attr) == getattr(scratch, attr), attr
    assert state.top_generation >= scratch.top_generation  # a high-water mark: never lowered
    if state.indexed:
        assert state.view(replicas).content() == scratch.view(replicas).content()
