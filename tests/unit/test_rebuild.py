"""State rebuilt from the engines the nodes run (server/reconcile/rebuild.py), and a reconcile pass
after it that changes nothing."""

from __future__ import annotations

from fakes.cluster import cluster, node
from llmgw.model.deployment import Deployment, Replica
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.server.placement.place import NodeView
from llmgw.server.reconcile.rebuild import rebuild
from llmgw.server.reconcile.rules import reconcile

D = Deployment("demo", "org/m", EngineKind.VLLM, 8, 2, selector={"pool": "a"}, args=("--x",))


def pool(*nodes: str) -> dict[str, NodeView]:
    return cluster(*(node(n, labels={"pool": "a"}) for n in nodes))


def running(nodes: tuple[str, ...], d: Deployment = D, floor: int = 0) -> dict[str, Replica]:
    """What a server placed before it lost its state: a pass over an empty cluster."""
    res = reconcile({d.name: d}, {}, pool(*nodes), {}, 0.0, generation_floor=floor)
    return res.replicas


def hello_reports(replicas: dict[str, Replica]) -> dict[str, tuple[EngineReport, ...]]:
    out: dict[str, list[EngineReport]] = {}
    for r in replicas.values():
        for m, spec in zip(r.members, r.engine_specs(), strict=True):
            out.setdefault(m.node_id, []).append(
                EngineReport(r.id, r.generation, EngineState.READY, spec=spec))
    return {n: tuple(rs) for n, rs in out.items()}


def test_an_empty_server_adopts_what_runs_and_a_pass_changes_nothing() -> None:
    before = running(("a", "b"))
    reports = hello_reports(before)
    views = pool("a", "b")
    addrs = {n: v.info.mgmt_addr for n, v in views.items()}
    res = rebuild({}, {}, reports, addrs, 0, 10.0)
    assert sorted(res.adopted) == sorted(before) and res.created == ("demo",)
    d = res.deployments["demo"]
    assert d.replicas == 2 and d.template_hash() == D.template_hash()
    assert {rid: (r.generation, r.members) for rid, r in res.replicas.items()} == {
        rid: (r.generation, tuple(m for m in r.members)) for rid, r in before.items()}
    assert res.generation_floor == max(r.generation for r in before.values())
    after = reconcile(res.deployments, res.replicas, views, reports, 11.0,
                      generation_floor=res.generation_floor)
    assert after.changed_nodes == frozenset()  # nothing started, nothing stopped
    assert all(r.state == "ready" for r in after.replicas.values())


def test_nodes_saying_hello_one_by_one_grow_the_rebuilt_deployment() -> None:
    reports = hello_reports(running(("a", "b")))
    first = rebuild({}, {}, {"a": reports["a"]}, {}, 0, 1.0)
    assert first.deployments["demo"].replicas == 1
    second = rebuild(first.deployments, first.replicas, {"b": reports["b"]}, {},
                     first.generation_floor - 1, 2.0, frozenset(first.created))
    assert second.deployments["demo"].replicas == 2 and len(second.replicas) == 2


def test_engines_at_or_below_the_floor_are_not_adopted() -> None:
    # The server stopped them on purpose: its generation floor is past them.
    reports = hello_reports(running(("a",)))
    gen = next(iter(reports["a"])).generation
    res = rebuild({}, {}, reports, {}, gen, 1.0)
    assert res.adopted == () and res.deployments == {}


def test_an_applied_deployment_keeps_its_count_and_a_gang_waits_for_every_member() -> None:
    applied = {"demo": evolve_replicas(D, 5)}
    res = rebuild(applied, {}, hello_reports(running(("a",))), {}, 0, 1.0)
    assert res.deployments["demo"].replicas == 5 and res.created == ()
    gang = Deployment("g", "org/m", EngineKind.VLLM, 8, 1, nodes=2)
    views = cluster(node("a", fabrics=("ib",)), node("b", fabrics=("ib",)))
    placed = reconcile({"g": gang}, {}, views, {}, 0.0).replicas
    reports = hello_reports(placed)
    half = rebuild({}, {}, {"a": reports["a"]}, {}, 0, 1.0)
    assert half.adopted == () and half.waiting == {"a"}
    whole = rebuild({}, {}, reports, {}, 0, 1.0)
    assert whole.adopted == ("g-0",) and len(whole.replicas["g-0"].members) == 2


def test_a_record_with_a_bad_origin_is_noted_not_adopted() -> None:
    reports = hello_reports(running(("a",)))
    rep = reports["a"][0]
    assert rep.spec is not None
    bad = evolve_report(rep, {**rep.spec.origin, "gpus_per_node": 0})
    res = rebuild({}, {}, {"a": (bad,)}, {}, 0, 1.0)
    assert res.adopted == () and "gpus_per_node" in res.notes[0]


def evolve_replicas(d: Deployment, n: int) -> Deployment:
    from attrs import evolve

    return evolve(d, replicas=n)


def evolve_report(rep: EngineReport, origin: dict[str, object]) -> EngineReport:
    from attrs import evolve

    assert rep.spec is not None
    return evolve(rep, spec=evolve(rep.spec, origin=origin))


def test_an_engine_of_another_state_is_adopted_though_its_generation_is_below_the_floor() -> None:
    """Nodes say Hello one by one: adopting a later generation first raises the floor
    above an earlier one that another node runs (seen in the integration test)."""
    before = running(("a", "b"))
    marked = {n: tuple(evolve_issuer(r, "lost-state") for r in rs) for n, rs in hello_reports(before).items()}
    late = next(n for n, rs in marked.items() if rs[0].generation == min(r.generation for r in before.values()))
    early = next(n for n in marked if n != late)
    first = rebuild({}, {}, {early: marked[early]}, {}, 0, 1.0, state_id="this-state")
    assert first.generation_floor > marked[late][0].generation
    second = rebuild(first.deployments, first.replicas, {late: marked[late]}, {}, first.generation_floor,
                     2.0, frozenset(first.created), state_id="this-state")
    assert len(second.adopted) == 1 and second.deployments["demo"].replicas == 2
    # This state's own engine, unknown and at or below the floor, was stopped on purpose.
    own = {late: tuple(evolve_issuer(r, "this-state") for r in marked[late])}
    assert rebuild(first.deployments, first.replicas, own, {}, first.generation_floor, 2.0,
                   frozenset(first.created), state_id="this-state").adopted == ()


def evolve_issuer(rep: EngineReport, issuer: str) -> EngineReport:
    from attrs import evolve

    assert rep.spec is not None
    return evolve(rep, spec=evolve(rep.spec, issuer=issuer))
