"""Placement and reconcile properties over random clusters (hypothesis)."""

from __future__ import annotations

from collections import Counter

from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes.cluster import node
from llmgw.model.deployment import Deployment, Strategy
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.model.gpu_need import memory_need
from llmgw.model.inventory import FabricState, GpuProcess, StorageReport
from llmgw.model.node import NodeState
from llmgw.server.placement.place import ClusterView, NodeView, Placement, place
from llmgw.server.reconcile.rules import desired_sets, reconcile

MODEL = "org/m"
FABRICS = ("ib-a", "ib-b")


@st.composite
def node_views(draw: st.DrawFn, node_id: str) -> NodeView:
    count = draw(st.integers(0, 8))
    fabrics = draw(
        st.lists(
            st.tuples(st.sampled_from(FABRICS), st.sampled_from(list(FabricState))),
            max_size=2,
            unique_by=lambda f: f[0],
        )
    )
    holds = draw(st.sampled_from(["full", "partial", "none", "not-asked"]))
    v = node(
        node_id,
        count,
        fabrics=fabrics,
        holds=[MODEL] if holds == "full" else [],
        partial=[MODEL] if holds == "partial" else [],
        asked=holds != "not-asked",
        name=draw(st.sampled_from(["H100", "A100"])),
        memory=draw(st.sampled_from([40000, 81559])),
        nvlink=draw(st.booleans()),
        islands=draw(st.sampled_from([1, 2])),
        state=draw(st.sampled_from([NodeState.READY] * 4 + [NodeState.SUSPECT, NodeState.LOST])),
        cordoned=draw(st.booleans()) and draw(st.booleans()),
        port_range=(20000, 20000 + draw(st.sampled_from([3, 40, 1000]))),
    )
    # GPUs others hold: unhealthy, releasing, or most of their memory taken.
    marked = []
    for g in v.inventory.gpus:
        how = draw(st.sampled_from(["ok"] * 5 + ["sick", "releasing", "held"]))
        if how == "sick":
            g = evolve(g, problems=("row remap pending",))
        elif how == "releasing":
            g = evolve(g, releasing="d-0 stopped; 70 GiB still held")
        elif how == "held":
            g = evolve(g, memory_free=10240, processes=(GpuProcess(4242, "python train.py", g.memory_total - 10240),))
        marked.append(g)
    return evolve(v, inventory=evolve(v.inventory, gpus=tuple(marked)))


def usable(v: NodeView, d: Deployment) -> set[str]:
    """The GPUs of `v` a replica of `d` may have: placeable, with its need free."""
    return {g.uuid for g in v.inventory.gpus if g.placeable and g.memory_free
            >= memory_need(d.engine, d.args, g.memory_total, d.gpu_memory_min)}


@st.composite
def clusters(draw: st.DrawFn) -> dict[str, NodeView]:
    n = draw(st.integers(1, 10))
    return {f"n{i}": draw(node_views(f"n{i}")) for i in range(n)}


@st.composite
def deployments(draw: st.DrawFn) -> Deployment:
    return Deployment(
        name="d",
        model=MODEL,
        engine=draw(st.sampled_from([EngineKind.VLLM, EngineKind.SGLANG])),
        gpus_per_node=draw(st.integers(1, 8)),
        replicas=1,
        nodes=draw(st.sampled_from([1, 1, 2, 3])),
        gpu_memory_min=draw(st.sampled_from([0, 0, 80000])),
        strategy=draw(st.sampled_from(list(Strategy))),
    )


def strip_weights(c: dict[str, NodeView]) -> dict[str, NodeView]:
    return {
        k: evolve(v, inventory=evolve(v.inventory, storage=StorageReport(asked=True)))
        for k, v in c.items()
    }


def holds(v: NodeView) -> bool:
    return v.inventory.storage.holds(MODEL)


PROPS = settings(max_examples=150, deadline=None)


@PROPS
@given(clusters(), st.lists(deployments(), min_size=1, max_size=6))
def test_no_gpu_or_port_given_twice(c: dict[str, NodeView], ds: list[Deployment]) -> None:
    view = ClusterView(c)
    gpus: list[str] = []
    ports: list[tuple[str, int]] = []
    for d in ds:
        p = place(d, view)
        if not isinstance(p, Placement):
            continue
        view.reserve(p.members)
        for m in p.members:
            assert set(m.gpus) <= usable(c[m.node_id], d)
            assert {g.uuid for g in c[m.node_id].inventory.gpus} >= set(m.gpus)
            assert len(m.gpus) == d.gpus_per_node
            gpus += m.gpus
            ports += [(m.node_id, port) for port in m.bound_ports()]
            lo, hi = c[m.node_id].info.port_range
            assert all(lo <= port <= hi for port in m.bound_ports())
    assert len(gpus) == len(set(gpus))
    assert len(ports) == len(set(ports))


@PROPS
@given(clusters(), deployments())
def test_gang_members_share_one_up_fabric_and_islands_hold_none(
    c: dict[str, NodeView], d: Deployment
) -> None:
    p = place(d, c)
    if not isinstance(p, Placement):
        return
    members = [c[m.node_id] for m in p.members]
    assert len({v.info.node_id for v in members}) == d.nodes == len(p.members)
    for v in members:
        assert v.state == NodeState.READY and not v.cordoned
    if d.nodes > 1:
        assert p.fabric
        for v in members:
            assert v.inventory.fabrics, "an island holds a multi-node replica"
            states = {f.name: f.state for f in v.inventory.fabrics}
            assert states.get(p.fabric) in (FabricState.UP, FabricState.DEGRADED)
        assert len({v.inventory.gpus[0].name for v in members}) == 1


@PROPS
@given(clusters(), deployments())
def test_a_fitting_holder_is_always_chosen(c: dict[str, NodeView], d: Deployment) -> None:
    d = evolve(d, nodes=1)
    fitting_holders = [
        nid for nid, v in c.items() if holds(v) and isinstance(place(d, {nid: v}), Placement)
    ]
    p = place(d, c)
    if fitting_holders:
        assert isinstance(p, Placement)
        assert holds(c[p.members[0].node_id])


@PROPS
@given(clusters(), deployments())
def test_gang_takes_as_many_holders_as_any_member_set_could(
    c: dict[str, NodeView], d: Deployment
) -> None:
    p = place(d, c)
    if isinstance(p, Placement) and d.nodes > 1:
        # Whenever a fabric could run the gang with a holder in it, the chosen one has one.
        for fabric in FABRICS:
            sub = {k: v for k, v in c.items() if any(f.name == fabric for f in v.inventory.fabrics)}
            alt = place(d, sub)
            if isinstance(alt, Placement) and alt.holders:
                assert p.holders >= 1


@PROPS
@given(clusters(), deployments())
def test_removing_weights_never_makes_a_replica_unschedulable(
    c: dict[str, NodeView], d: Deployment
) -> None:
    with_weights = isinstance(place(d, c), Placement)
    without = isinstance(place(d, strip_weights(c)), Placement)
    assert with_weights == without


@settings(max_examples=60, deadline=None)
@given(
    clusters(),
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 9), st.sampled_from(list(NodeState))), max_size=6),
    st.lists(st.sampled_from(list(EngineState)), min_size=1, max_size=6),
)
def test_reconcile_never_double_books_or_serves_an_id_twice(
    c: dict[str, NodeView],
    replicas: int,
    changes: list[tuple[int, NodeState]],
    outcomes: list[EngineState],
) -> None:
    d = Deployment(name="d", model=MODEL, engine=EngineKind.VLLM, gpus_per_node=2, replicas=replicas)
    reps: dict = {}
    floor, now = 0, 100.0
    ids = sorted(c)
    for step, outcome in enumerate(outcomes):
        if step < len(changes):
            i, state = changes[step]
            nid = ids[i % len(ids)]
            c[nid] = evolve(c[nid], state=state, silent_since=None if state == "ready" else now)
        reports = {
            m.node_id: [EngineReport(r.id, r.generation, outcome)]
            for r in reps.values()
            for m in r.members
        }
        res = reconcile({"d": d}, reps, c, reports, now, generation_floor=floor)
        reps, floor, now = res.replicas, res.generation_floor, now + 400
        slots = [r for r in reps.values() if not r.replaces]
        assert len(slots) == replicas
        booked = Counter((m.node_id, g) for r in reps.values() for m in r.members for g in m.gpus)
        assert all(n == 1 for n in booked.values())
        keys = Counter(
            spec.replica_id for specs in desired_sets(reps.values()).values() for spec in specs
            if spec.gang is None
        )
        assert all(n == 1 for n in keys.values())
