"""What the operator sees of a GPU that is unhealthy, held or releasing (issue 18 item 3,
server side): the status document, `ctl describe node` and `get nodes`, and the server's
llmgw_server_gpus gauge."""

from __future__ import annotations

from types import SimpleNamespace

from test_metrics_collectors import at, scrape

from llmgw.config.server import ServerConfig
from llmgw.ctl.render import render
from llmgw.model.inventory import Gpu, GpuProcess, Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.elastic.autoscaler import Autoscaler
from llmgw.server.metrics import ServerMetrics
from llmgw.server.peers.sessions import ControlPlane, Node
from llmgw.server.status import describe_node, node_view

TOTAL = 81559


def gpu(i: int, **kw: object) -> Gpu:
    return Gpu(index=i, uuid=f"GPU-{i}", name="H100", memory_total=TOTAL,
               memory_free=kw.pop("memory_free", TOTAL), pci_bus_id=f"00000000:{i:02x}:00.0",  # type: ignore[arg-type]
               **kw)  # type: ignore[arg-type]


GPUS = (
    gpu(0, processes=(GpuProcess(4242, "python train.py --big", 61 * 1024),), memory_free=TOTAL - 61 * 1024),
    gpu(1, problems=("row remap pending", "2 volatile uncorrected ECC errors")),
    gpu(2, releasing="d-3 stopped; 70 GiB still held by pid 77 (D state)"),
    gpu(3),
)


def a_node(node_id: str = "n1", gpus: tuple[Gpu, ...] = GPUS, state: NodeState = NodeState.READY) -> Node:
    return Node(node_id, NodeInfo(node_id, "10.0.0.1"), Inventory(gpus=gpus), state, 0.0, b"")


def test_the_status_document_says_each_gpus_state_and_why() -> None:
    doc = node_view(a_node(), 0.0)
    g = {x["index"]: x for x in doc["gpus"]}
    assert [g[i]["state"] for i in range(4)] == ["held", "unhealthy", "releasing", "healthy"]
    assert g[0]["processes"] == [{"pid": 4242, "command": "python train.py --big", "memory": 61 * 1024}]
    assert g[1]["problems"] == ["row remap pending", "2 volatile uncorrected ECC errors"]
    assert g[2]["releasing"].startswith("d-3 stopped")
    assert g[3]["problems"] == [] and g[3]["processes"] == [] and g[3]["releasing"] == ""


def test_describe_node_names_every_problem_holder_and_release() -> None:
    o = SimpleNamespace(replicas={}, last_events={})
    text = render("describe", "node", describe_node(o, a_node(), 0.0))  # type: ignore[arg-type]
    assert "GPU 1 unhealthy: row remap pending" in text
    assert "GPU 1 unhealthy: 2 volatile uncorrected ECC errors" in text
    assert "GPU 0 held by pid 4242 (python train.py --big), 61 GiB" in text
    assert "GPU 2 releasing: d-3 stopped; 70 GiB still held by pid 77 (D state)" in text
    assert "GPU 3" not in text  # healthy: a row of the table, no note
    header = next(line for line in text.splitlines() if line.startswith("INDEX"))
    assert "STATE" in header
    narrow = render("get", "node", [node_view(a_node(), 0.0)])
    assert "1 unhealthy, 1 releasing, 1 held" in narrow


def test_a_hostile_command_stays_on_one_bounded_line() -> None:
    bad = (gpu(0, processes=tuple(GpuProcess(i, "x\n\x1b[2J" + "y" * 5000, 1) for i in range(50))),)
    o = SimpleNamespace(replicas={}, last_events={})
    text = render("describe", "node", describe_node(o, a_node(gpus=bad), 0.0))  # type: ignore[arg-type]
    notes = [line for line in text.splitlines() if line.startswith("  GPU 0 held")]
    assert len(notes) == 6 and all(len(line) < 120 and "\x1b" not in line for line in notes)


def test_the_gpus_gauge_counts_by_state_on_nodes_not_lost() -> None:
    cp = ControlPlane(config=ServerConfig())
    for n in (a_node("n1"), a_node("n2", (gpu(0), gpu(1))), a_node("n3", state=NodeState.LOST)):
        cp.seed(n)
    o = SimpleNamespace(cp=cp, deployments={}, replicas={}, pending={}, holding="", failed_passes=0,
                        on_pass=None,
                        autoscaler=Autoscaler())
    m = ServerMetrics()
    m.watch(o)  # type: ignore[arg-type]
    s = scrape(m.registry)
    assert {x: at(s, "llmgw_server_gpus", state=x) for x in ("healthy", "unhealthy", "releasing", "held")} == {
        "healthy": 3, "unhealthy": 1, "releasing": 1, "held": 1}
    # A new inventory is counted at the next scrape; a node gone is forgotten.
    cp.nodes["n2"].inventory = Inventory(gpus=(gpu(0, problems=("lost: GPU is lost",)), gpu(1)))
    o.cp = ControlPlane(config=ServerConfig())  # the same table without n1
    for n in (cp.nodes["n2"], cp.nodes["n3"]):
        o.cp.seed(n)
    s = scrape(m.registry)
    assert at(s, "llmgw_server_gpus", state="unhealthy") == 1
    assert at(s, "llmgw_server_gpus", state="healthy") == 1
    assert at(s, "llmgw_server_gpus", state="held") == 0
    assert set(m.gpu_counts) == {"n2"}
