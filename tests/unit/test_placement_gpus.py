"""Placement against what the agent reports per GPU: free memory, foreign processes,
problems, releasing (issue 18 items 3 and 4 on the server's side)."""

from __future__ import annotations

from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes.cluster import cluster, node
from llmgw.model.deployment import Deployment
from llmgw.model.engine import EngineKind
from llmgw.model.inventory import Gpu, GpuProcess
from llmgw.server.placement.place import ClusterView, NodeView, Placement, Unschedulable, place

GIB = 1024
TOTAL = 81559  # an H100 80GB, MiB


def dep(gpus: int = 1, **kw: object) -> Deployment:
    kw.setdefault("engine", EngineKind.VLLM)
    return Deployment(name="d", model="org/m", gpus_per_node=gpus, replicas=1, **kw)  # type: ignore[arg-type]


def with_gpus(v: NodeView, **changes: dict[str, object]) -> NodeView:
    """`v` with GPU index -> attribute changes applied."""
    gpus = tuple(evolve(g, **changes.get(str(g.index), {})) for g in v.inventory.gpus)  # type: ignore[arg-type]
    return evolve(v, inventory=evolve(v.inventory, gpus=gpus))


def held(pid: int = 4242, command: str = "python train.py", used: int = 61 * GIB) -> dict[str, object]:
    return {"memory_free": TOTAL - used, "processes": (GpuProcess(pid, command, used),)}


def indexes(p: Placement | Unschedulable, v: NodeView) -> list[int]:
    assert isinstance(p, Placement), p
    by_uuid = {g.uuid: g.index for g in v.inventory.gpus}
    return sorted(by_uuid[u] for m in p.members for u in m.gpus)


def test_a_gpu_with_10_gib_free_is_no_place_for_vllm_at_0_9() -> None:
    # The headline: 0.9 x 80 GiB and the engine's CUDA context (1 GiB) must be free;
    # another process leaves 10 GiB.
    v = with_gpus(node("a", 1), **{"0": {"memory_free": 10 * GIB}})
    r = place(dep(1), cluster(v))
    assert isinstance(r, Unschedulable)
    assert r.reason.startswith("0/1 nodes fit: 1 lacked 1 free GPU with 73 GiB free. a: ")
    # Another node with its memory free takes it.
    assert ok_node(place(dep(1), cluster(v, node("b", 1)))) == "b"


def ok_node(p: Placement | Unschedulable) -> str:
    assert isinstance(p, Placement), p
    return p.members[0].node_id


def test_the_engines_own_fraction_and_gpu_memory_min_decide_the_need() -> None:
    v = with_gpus(node("a", 1), **{"0": {"memory_free": 10 * GIB}})
    c = cluster(v)
    assert isinstance(place(dep(1, args=("--gpu-memory-utilization", "0.1")), c), Placement)
    assert isinstance(place(dep(1, args=("--gpu-memory-utilization=0.1",), gpu_memory_min=12 * GIB), c),
                      Unschedulable)
    # 0.11 x 80 GiB and the 1 GiB context fit in 10 GiB; 0.12 x 80 GiB and the context do not.
    assert isinstance(place(dep(1, engine=EngineKind.SGLANG, args=("--mem-fraction-static", "0.11")), c),
                      Placement)
    assert isinstance(place(dep(1, engine=EngineKind.SGLANG, args=("--mem-fraction-static", "0.12")), c),
                      Unschedulable)
    assert isinstance(place(dep(1, engine=EngineKind.SGLANG), c), Unschedulable)
    # The simulated engine takes no share: only gpu_memory_min counts.
    assert isinstance(place(dep(1, engine=EngineKind.SIMULATED), c), Placement)


def test_gpus_others_hold_are_skipped_and_the_rest_given() -> None:
    v = with_gpus(node("a", 8), **{"0": held(), "1": held(), "5": {"memory_free": 2 * GIB}})
    p = place(dep(4), cluster(v))
    assert not {0, 1, 5} & set(indexes(p, v))
    assert isinstance(place(dep(6), cluster(v)), Unschedulable)
    # A foreign process that leaves enough free does not keep a GPU out.
    small = with_gpus(node("a", 1), **{"0": held(used=4 * GIB)})
    assert indexes(place(dep(1), cluster(small)), small) == [0]


def test_unhealthy_and_releasing_gpus_are_never_placed() -> None:
    v = with_gpus(node("a", 4), **{"2": {"problems": ("row remap pending",)},
                                   "3": {"releasing": "d-1 stopped; 70 GiB still held by pid 77"}})
    view = ClusterView(cluster(v))
    assert view.free_gpus("a") == ("GPU-a-0", "GPU-a-1")
    p = place(dep(2), view)
    assert indexes(p, v) == [0, 1]
    assert isinstance(p, Placement)
    view.reserve(p.members)
    r = place(dep(1), view)
    assert isinstance(r, Unschedulable)
    assert r.reason == (
        "0/1 nodes fit: 1 lacked 1 free GPU. a: GPU 2 unhealthy (row remap pending); "
        "GPU 3 releasing (d-1 stopped; 70 GiB still held by pid 77); GPUs 0-1 held by "
        "replicas; 0 GPUs free, 1 needed")
    # Once healthy and released (a new inventory), the GPUs are given again.
    view.update_node("a", node("a", 4))
    assert indexes(place(dep(2), view), v) == [2, 3]


def test_explain_names_every_cause_on_the_node() -> None:
    v = with_gpus(node("node-3", 7), **{
        "2": {"problems": ("row remap pending",)},
        "0": held(), "1": held(),
        "4": {"releasing": "d-7 stopped; 20 GiB not back"},
    })
    r = place(dep(4), cluster(v, node("n9", 8, cordoned=True)))
    assert isinstance(r, Unschedulable)
    assert r.reason == (
        "0/2 nodes fit: 1 cordoned, 1 lacked 4 free GPUs with 73 GiB free. node-3: GPU 2 "
        "unhealthy (row remap pending); GPUs 0-1 held by other processes (pid 4242 python "
        "train.py 61 GiB); GPU 4 releasing (d-7 stopped; 20 GiB not back); 3 GPUs with >= "
        "73 GiB free, 4 needed")
    assert r.counts == {"cordoned": 1, "lacked 4 free GPUs with 73 GiB free": 1}


def test_a_node_full_of_our_own_replicas_reads_as_before() -> None:
    # Nothing but our replicas: the short reason, as ctl and the router's 503 have shown it.
    view = ClusterView(cluster(node("a", 8)))
    p = place(dep(8), view)
    assert isinstance(p, Placement)
    view.reserve(p.members)
    r = place(dep(8), view)
    assert isinstance(r, Unschedulable) and r.reason == "0/1 nodes fit: 1 lacked 8 free GPUs"


def test_few_nodes_are_named_the_closest_first() -> None:
    nodes = [with_gpus(node(f"n{i}", 4), **{str(j): {"problems": ("MIG mode is on",)} for j in range(4 - i % 4)})
             for i in range(10)]
    r = place(dep(4), cluster(*nodes))
    assert isinstance(r, Unschedulable)
    named = [part.split(":")[0] for part in r.reason.split(". ")[1:-1]]
    assert named == ["n3", "n7", "n2"]  # 3 GPUs good, then 3, then 2 (ties by id)
    assert r.reason.endswith(". 7 more nodes kept out by GPUs that are not ours")


texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=3000)


@settings(max_examples=60, deadline=None)
@given(
    problems=st.lists(texts, max_size=20),
    procs=st.lists(st.tuples(st.integers(0, 2**31), texts, st.integers(0, 2**40)), max_size=30),
    releasing=texts,
    count=st.integers(1, 40),
)
def test_reasons_stay_bounded_and_printable_whatever_the_node_sends(
    problems: list[str], procs: list[tuple[int, str, int]], releasing: str, count: int
) -> None:
    gpus = []
    for g in node("a", count).inventory.gpus:
        if g.index % 3 == 0:
            g = evolve(g, problems=tuple(problems) or ("lost",))
        elif g.index % 3 == 1:
            g = evolve(g, memory_free=0, processes=tuple(GpuProcess(p, c, m) for p, c, m in procs))
        else:
            g = evolve(g, releasing=releasing or "x")
        gpus.append(g)
    views = [evolve(v, inventory=evolve(v.inventory, gpus=tuple(_renamed(gpus, v.info.node_id))))
             for v in (node(f"n{i}") for i in range(5))]
    r = place(dep(count + 1), cluster(*views))
    assert isinstance(r, Unschedulable)
    assert len(r.reason) < 1500
    assert r.reason.isprintable()


def _renamed(gpus: list[Gpu], nid: str) -> list[Gpu]:
    return [evolve(g, uuid=f"{nid}-{g.uuid}") for g in gpus]
