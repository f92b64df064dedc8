"""Placement on fixed inventories: every filter and preference."""

from __future__ import annotations

import json

from fakes.cluster import cluster, node
from llmgw.model.deployment import (
    ENGINE_PORT_BLOCK,
    RAY_PORT_BLOCK,
    SGLANG_DIST_INIT,
    SGLANG_DIST_INIT_NEIGHBOURS,
    Deployment,
    Member,
    Replica,
    Strategy,
)
from llmgw.model.engine import EngineKind, EngineSpec
from llmgw.model.inventory import FabricState
from llmgw.model.node import NodeState
from llmgw.server.placement.place import ClusterView, Placement, Unschedulable, place
from llmgw.transport.codec import converter


def dep(gpus: int = 1, nodes: int = 1, **kw: object) -> Deployment:
    kw.setdefault("engine", EngineKind.VLLM)
    return Deployment(
        name="d", model="org/m", gpus_per_node=gpus, replicas=1, nodes=nodes, **kw  # type: ignore[arg-type]
    )


def ok(result: Placement | Unschedulable) -> Placement:
    assert isinstance(result, Placement), result
    return result


def nodes_of(p: Placement) -> list[str]:
    return [m.node_id for m in p.members]


def test_single_node_basic_ports_and_gpus() -> None:
    p = ok(place(dep(4), cluster(node("a"))))
    (m,) = p.members
    assert m.node_id == "a" and m.rank == 0 and len(m.gpus) == 4
    assert m.port == 20000 and m.rendezvous_port == 0 and m.ray_port_base == 0


def test_not_ready_cordoned_draining_filtered_with_aggregated_reason() -> None:
    c = cluster(
        node("a", state=NodeState.SUSPECT),
        node("b", state=NodeState.LOST),
        node("c", cordoned=True),
        node("d", draining=True),
        node("e", 4),
        node("f", 4),
    )
    r = place(dep(8), c)
    assert isinstance(r, Unschedulable)
    assert r.reason.startswith("0/6 nodes fit: 2 lacked 8 free GPUs")
    for part in ("1 cordoned", "1 draining", "1 were suspect", "1 were lost"):
        assert part in r.reason


def test_selector_and_memory() -> None:
    c = cluster(
        node("a", labels={"rack": "r1"}),
        node("b", labels={"rack": "r2"}, memory=40000),
        node("c", labels={"rack": "r2"}),
    )
    assert nodes_of(ok(place(dep(1, selector={"rack": "r2"}), c))) in (["b"], ["c"])
    assert nodes_of(ok(place(dep(1, selector={"rack": "r2"}, gpu_memory_min=80000), c))) == ["c"]
    r = place(dep(1, selector={"rack": "r9"}), c)
    assert isinstance(r, Unschedulable) and "3 lacked labels rack=r9" in r.reason
    r = place(dep(1, gpu_memory_min=100000), c)
    assert isinstance(r, Unschedulable) and r.reason == "0/3 nodes fit: 3 lacked 1 free GPU with 98 GiB free"


def test_used_gpus_are_never_given() -> None:
    c = cluster(node("a"))
    view = ClusterView(c)
    seen: set[str] = set()
    for _ in range(4):
        p = ok(place(dep(2), view))
        view.reserve(p.members)
        assert not seen & set(p.members[0].gpus)
        seen |= set(p.members[0].gpus)
        assert len({m.port for m in p.members}) == 1
    assert isinstance(place(dep(2), view), Unschedulable)


def test_ports_never_two_alike_on_a_node() -> None:
    view = ClusterView(cluster(node("a", 16, port_range=(30000, 30003))))
    sim = dep(1, engine=EngineKind.SIMULATED)  # the HTTP port only: no engine block
    ports = []
    for _ in range(4):
        p = ok(place(sim, view))
        view.reserve(p.members)
        ports.append(p.members[0].port)
    assert sorted(ports) == [30000, 30001, 30002, 30003]
    r = place(sim, view)
    assert isinstance(r, Unschedulable) and "lacked free ports" in r.reason


def test_vllm_and_sglang_engines_get_a_port_block_of_their_own() -> None:
    # Engines starting together on one node each get their own block (VLLM_PORT, SGLang's
    # --nccl-port and dist-init ports) instead of racing for the same free port.
    per = 1 + ENGINE_PORT_BLOCK
    view = ClusterView(cluster(node("a", 16, port_range=(30000, 30000 + 3 * per - 1))))
    seen: set[int] = set()
    for engine in (EngineKind.VLLM, EngineKind.SGLANG, EngineKind.VLLM):
        (m,) = ok(place(dep(1, engine=engine), view)).members
        view.reserve((m,))
        block = set(range(m.port_base, m.port_base + ENGINE_PORT_BLOCK))
        assert m.port_base and m.port not in block and block <= set(m.bound_ports())
        assert len(m.bound_ports()) == per and not seen & set(m.bound_ports())
        seen |= set(m.bound_ports())
    assert seen == set(range(30000, 30000 + 3 * per))
    r = place(dep(1), view)
    assert isinstance(r, Unschedulable) and "lacked free ports" in r.reason
    # The simulated engine binds only what it is given: no block.
    assert ok(place(dep(1, engine=EngineKind.SIMULATED), cluster(node("b")))).members[0].port_base == 0


def test_engine_block_travels_to_the_engine_spec() -> None:
    (m,) = ok(place(dep(1), cluster(node("a")))).members
    r = Replica(id="d-0", deployment="d", index=0, spec=dep(1), members=(m,))
    (s,) = r.engine_specs()
    assert s.port_base == m.port_base != 0


def test_member_from_before_the_block_keeps_working() -> None:
    # A Member (and EngineSpec) decoded from an older server or store has no port_base.
    old = {"node_id": "a", "rank": 0, "gpus": ["GPU-1"], "port": 20000, "addr": "10.0.0.1"}
    m = converter.structure(old, Member)
    assert m.port_base == 0 and m.bound_ports() == (20000,)
    (s,) = Replica(id="d-0", deployment="d", index=0, spec=dep(1), members=(m,)).engine_specs()
    assert s.port_base == 0
    wire = json.loads(json.dumps(converter.unstructure(s)))  # as it travels: plain values
    del wire["port_base"]
    assert converter.structure(wire, EngineSpec) == s


def test_sglang_gang_rendezvous_and_its_neighbours_lie_in_the_head_block() -> None:
    # SGLang with --enable-dp-attention binds its dist-init port and the six after it.
    c = cluster(node("a", fabrics=["ib"]), node("b", fabrics=["ib"]))
    head, other = ok(place(dep(8, nodes=2, engine=EngineKind.SGLANG), c)).members
    dist_init = head.rendezvous_port
    assert dist_init == head.port_base + SGLANG_DIST_INIT
    wanted = set(range(dist_init, dist_init + 1 + SGLANG_DIST_INIT_NEIGHBOURS))
    assert wanted <= set(range(head.port_base, head.port_base + ENGINE_PORT_BLOCK))
    assert wanted <= set(head.bound_ports())
    assert len(set(head.bound_ports())) == len(head.bound_ports()) == 1 + ENGINE_PORT_BLOCK
    assert other.rendezvous_port == dist_init and other.port_base
    assert len(other.bound_ports()) == 1 + ENGINE_PORT_BLOCK


def test_nvlink_clique_preferred_within_node() -> None:
    # Two NVLink islands of 4: a TP=4 group is one island, not a mix.
    p = ok(place(dep(4), cluster(node("a", islands=2))))
    idx = sorted(int(u.rsplit("-", 1)[1]) for u in p.members[0].gpus)
    assert idx in ([0, 1, 2, 3], [4, 5, 6, 7])
    assert p.nvlink == 1


def test_nvlink_node_preferred_over_strategy() -> None:
    c = cluster(node("a", 8, nvlink=False), node("b", 4))
    assert nodes_of(ok(place(dep(4, strategy=Strategy.SPREAD), c))) == ["b"]


def test_no_nvlink_takes_closest_gpus_same_numa() -> None:
    p = ok(place(dep(4), cluster(node("a", 8, nvlink=False))))
    idx = sorted(int(u.rsplit("-", 1)[1]) for u in p.members[0].gpus)
    assert idx in ([0, 1, 2, 3], [4, 5, 6, 7]) and p.nvlink == 0


def test_strategy_pack_and_spread() -> None:
    c = cluster(node("a", 8), node("b", 2))
    assert nodes_of(ok(place(dep(2, strategy=Strategy.PACK), c))) == ["b"]
    assert nodes_of(ok(place(dep(2, strategy=Strategy.SPREAD), c))) == ["a"]


def test_weights_dominate_strategy_and_nvlink() -> None:
    c = cluster(node("a", 8), node("b", 2), node("c", 8, nvlink=False, holds=["org/m"]))
    assert nodes_of(ok(place(dep(2, strategy=Strategy.PACK), c))) == ["c"]
    assert nodes_of(ok(place(dep(2, strategy=Strategy.SPREAD), c))) == ["c"]


def test_weights_by_path_count() -> None:
    c = cluster(node("a", 8), node("b", 8, holds=["x"]))
    d = Deployment(name="d", model="/models/x", engine=EngineKind.VLLM, gpus_per_node=1, replicas=1)
    assert nodes_of(ok(place(d, c))) == ["b"]


def test_not_asked_ranks_like_asked_nothing_and_partial_is_none() -> None:
    base = [node("a", 8, asked=False), node("b", 8, asked=True), node("c", 8, partial=["org/m"])]
    for strat in Strategy:
        p = ok(place(dep(2, strategy=strat), cluster(*base)))
        assert p.holders == 0
        assert nodes_of(p) == ["a"]  # equal rank: the first by id, whatever was asked


def test_holder_that_does_not_fit_is_skipped() -> None:
    c = cluster(node("a", 8), node("b", 2, holds=["org/m"]))
    assert nodes_of(ok(place(dep(4), c))) == ["a"]


def test_gang_in_one_fabric_same_gpu_model() -> None:
    c = cluster(
        node("a", fabrics=["ib-a"]),
        node("b", fabrics=["ib-b"]),
        node("c", fabrics=["ib-b"], name="NVIDIA A100"),
        node("d", fabrics=["ib-b"]),
    )
    p = ok(place(dep(8, nodes=2), c))
    assert sorted(nodes_of(p)) == ["b", "d"] and p.fabric == "ib-b"
    head, other = p.members
    assert head.rank == 0 and other.rank == 1
    assert head.rendezvous_port and head.ray_port and head.ray_port_base
    assert other.rendezvous_port == head.rendezvous_port and other.ray_port == head.ray_port
    assert len(set(head.bound_ports())) == len(head.bound_ports()) == 3 + RAY_PORT_BLOCK + ENGINE_PORT_BLOCK
    assert len(set(other.bound_ports())) == len(other.bound_ports()) == 1 + RAY_PORT_BLOCK + ENGINE_PORT_BLOCK
    assert other.hcas == ("mlx5_0", "mlx5_1")


def test_sglang_gang_has_no_ray_ports() -> None:
    c = cluster(node("a", fabrics=["ib"]), node("b", fabrics=["ib"]))
    p = ok(place(dep(8, nodes=2, engine=EngineKind.SGLANG), c))
    assert all(m.ray_port == 0 and m.ray_port_base == 0 for m in p.members)
    assert p.members[0].rendezvous_port


def test_gang_never_on_islands_or_down_fabric() -> None:
    c = cluster(node("a"), node("b"), node("c", fabrics=[("ib", FabricState.DOWN)]))
    r = place(dep(8, nodes=2), c)
    assert isinstance(r, Unschedulable)
    assert "2 lacked fabric" in r.reason and "1 had their fabric down" in r.reason
    c2 = cluster(node("a", fabrics=[("ib", FabricState.DEGRADED)]), node("b", fabrics=["ib"]))
    assert ok(place(dep(8, nodes=2), c2)).fabric == "ib"


def test_gang_unschedulable_explains_fabric_split() -> None:
    c = cluster(node("a", fabrics=["ib-a"]), node("b", fabrics=["ib-b"]))
    r = place(dep(8, nodes=2), c)
    assert isinstance(r, Unschedulable)
    assert "2 fit alone but no fabric has 2 of them" in r.reason


def test_gang_prefers_fabric_holding_weights() -> None:
    c = cluster(
        node("a1", fabrics=["ib-a"]),
        node("a2", fabrics=["ib-a"]),
        node("b1", fabrics=["ib-b"], holds=["org/m"]),
        node("b2", fabrics=["ib-b"], holds=["org/m"]),
    )
    p = ok(place(dep(8, nodes=2), c))
    assert p.fabric == "ib-b" and p.holders == 2


def test_reserve_release_round_trip() -> None:
    view = ClusterView(cluster(node("a", 2)))
    p = ok(place(dep(2), view))
    view.reserve(p.members)
    assert view.free_gpus("a") == ()
    view.release(p.members)
    assert len(view.free_gpus("a")) == 2
    view.reserve([Member(node_id="zz", rank=0, gpus=("x",), port=1)])  # unknown: ignored


def test_empty_cluster() -> None:
    r = place(dep(1), {})
    assert isinstance(r, Unschedulable) and "0/0 nodes fit" in r.reason
