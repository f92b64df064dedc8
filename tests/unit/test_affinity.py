"""GPU -> HCA affinity (issue 22): each placed GPU's nearest HCA of its fabric, read from a
fake sysfs tree through the agent's own discovery, and the environment every plan gets."""

from __future__ import annotations

from pathlib import Path

import attrs
from hypothesis import given
from hypothesis import strategies as st

from fakes import nvidia_smi as fake
from fakes.sysfs import _switch, add_hca, hca_device, pcie_tree
from llmgw.agent.discovery.discover import discover
from llmgw.agent.engines import build_plan
from llmgw.agent.process.spawn import default_plan
from llmgw.config.agent import (
    AgentConfig,
    DiscoveryConfig,
    EnginesConfig,
    FabricConfig,
    KeysConfig,
    VllmConfig,
)
from llmgw.ctl.render import _describe_replica
from llmgw.model.affinity import TIERS, for_member, link, nearest_hcas
from llmgw.model.deployment import Member
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec
from llmgw.model.inventory import Hca, IbPort, Inventory
from llmgw.model.pcie import link_kind
from llmgw.server.placement.fabrics import member_nics

# Two sockets, one host bridge and one PCIe switch each; under each switch two GPUs and
# one HCA. mlx5_0 is on fabric ib-a, mlx5_1 on ib-b: two fabrics on one node.
HOSTS = {"pci0000:15": 0, "pci0000:97": 1}
LAYOUT = {
    **_switch("pci0000:15", "0000:15:01.0", 0x16, ("gpu0", "gpu1", "mlx5_0")),
    **_switch("pci0000:97", "0000:97:01.0", 0x98, ("gpu2", "gpu3", "mlx5_1")),
}
BUSES = [LAYOUT[f"gpu{i}"][-1].split(":")[1] for i in range(4)]  # 18, 19, 9a, 9b
UUID = [fake.uuid(i) for i in range(4)]
TWO_FABRICS = (FabricConfig("ib-a", ("mlx5_0",), 200), FabricConfig("ib-b", ("mlx5_1",), 200))
ONE_FABRIC = (FabricConfig("ib", ("mlx5_0", "mlx5_1"), 200),)


def node(tmp_path: Path, fabrics: tuple[FabricConfig, ...], mode: str = "mp") -> AgentConfig:
    sys_root, ib = tmp_path / "sys", tmp_path / "sys" / "class" / "infiniband"
    if not ib.exists():
        pcie_tree(sys_root, LAYOUT, HOSTS)
        for h in ("mlx5_0", "mlx5_1"):
            add_hca(ib, h)
            hca_device(ib, h, sys_root, LAYOUT[h][-1])
        query = "".join(fake.query_line(i, fake.L40S, BUSES[i], 46068, 45000, "8.9") + "\n"
                        for i in range(4))
        cells = [["X" if i == j else ("PIX" if i // 2 == j // 2 else "SYS") for j in range(4)]
                 for i in range(4)]
        fake.write_script(tmp_path / "bin", query, fake.topo_matrix(cells, ["0", "0", "1", "1"]))
    return AgentConfig(
        node_id="gpu-1", server="tcp://127.0.0.1:7443", keys=KeysConfig("k", "s"),
        mgmt_addr="10.0.0.2", mgmt_interface="eno1",
        discovery=DiscoveryConfig(nvidia_smi=str(tmp_path / "bin" / "nvidia-smi"),
                                  ib_root=str(ib), prefer_nvml=False),
        fabrics=fabrics,
        engines=EnginesConfig(vllm=VllmConfig(bin="vllm", launch_mode=mode)),
    )


async def inventory(tmp_path: Path, cfg: AgentConfig) -> Inventory:
    return await discover(cfg, pci_root=str(tmp_path / "sys" / "bus" / "pci" / "devices"))


def gang_spec(gpus: tuple[str, ...], hcas: tuple[str, ...], kind: EngineKind = EngineKind.VLLM) -> EngineSpec:
    return EngineSpec(
        replica_id="r1", generation=1, deployment="d", model="org/m", served_name="m",
        engine=kind, gpus=gpus, port=20001, tensor_parallel=len(gpus), port_base=20100,
        gang=GangSpec(nnodes=2, rank=1, head_addr="10.0.0.1", rendezvous_port=29600, hcas=hcas,
                      ray_port=26379, ray_port_base=27000),
    )


INDICES = {u: i for i, u in enumerate(UUID)}


async def test_each_gpu_rides_the_hca_under_its_switch(tmp_path: Path) -> None:
    inv = await inventory(tmp_path, node(tmp_path, ONE_FABRIC))
    nics = for_member(inv.gpus, inv.hcas, UUID, ("mlx5_0", "mlx5_1"))
    assert [(n.index, n.hca, n.link) for n in nics] == [
        (0, "mlx5_0", "PIX"), (1, "mlx5_0", "PIX"), (2, "mlx5_1", "PIX"), (3, "mlx5_1", "PIX"),
    ]
    assert [n.hca_bus_id for n in nics] == [LAYOUT["mlx5_0"][-1]] * 2 + [LAYOUT["mlx5_1"][-1]] * 2
    # The tiers agree with the agent's own reading of the tree.
    for g in inv.gpus:
        for h in inv.hcas:
            assert link(g.pci_path, h.pci_path, g.numa_node, h.numa_node) == \
                link_kind(g.pci_path, h.pci_path, g.numa_node, h.numa_node)


async def test_two_fabrics_one_node_each_member_on_its_fabrics_hca(tmp_path: Path) -> None:
    cfg = node(tmp_path, TWO_FABRICS)
    inv = await inventory(tmp_path, cfg)
    assert [f.name for f in inv.fabrics] == ["ib-a", "ib-b"]
    # A member on ib-b with the GPUs of socket 0 has only mlx5_1, across the CPUs.
    far = for_member(inv.gpus, inv.hcas, UUID[:2], ("mlx5_1",))
    assert [n.line() for n in far] == ["GPU 0 -> mlx5_1 (SYS)", "GPU 1 -> mlx5_1 (SYS)"]
    near = for_member(inv.gpus, inv.hcas, UUID[2:], ("mlx5_1",))
    assert [n.line() for n in near] == ["GPU 2 -> mlx5_1 (PIX)", "GPU 3 -> mlx5_1 (PIX)"]


async def test_the_plans_environment_follows_from_the_tree(tmp_path: Path) -> None:
    cfg = node(tmp_path, ONE_FABRIC)
    inv = await inventory(tmp_path, cfg)
    hcas = ("mlx5_0", "mlx5_1")
    # vLLM's multiproc workers: its own per-worker map, GPU BDF = its switch's HCA BDF.
    env = default_plan(cfg, "py", inventory=lambda: inv)(gang_spec((UUID[0], UUID[3]), hcas),
                                                         INDICES).main.env
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"  # NCCL pairs them itself, names exact
    assert env["VLLM_GPU_NIC_PCIE_MAPPING"] == "00000000:18:00.0=0000:1a:00.0,00000000:9b:00.0=0000:9c:00.0"
    assert env["VLLM_NIC_SELECTION_VARS"] == "UCX_NET_DEVICES:1"
    assert "UCX_NET_DEVICES" not in env  # vLLM prepends to it: set, every worker sees both
    # Ray's workers and SGLang read no such map: the placed GPUs' HCAs, each once.
    ray = node(tmp_path, ONE_FABRIC, mode="ray")
    for c, kind in ((ray, EngineKind.VLLM), (cfg, EngineKind.SGLANG), (cfg, EngineKind.SIMULATED)):
        plan = default_plan(c, "py", inventory=lambda: inv)(gang_spec(tuple(UUID[:3]), hcas, kind), INDICES)
        for p in plan.processes:
            assert p.env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
            assert "VLLM_GPU_NIC_PCIE_MAPPING" not in p.env
    # Under one switch, one HCA: only that one.
    env = default_plan(cfg, "py", inventory=lambda: inv)(
        gang_spec(tuple(UUID[2:]), hcas, EngineKind.SGLANG), INDICES).main.env
    assert env["UCX_NET_DEVICES"] == "mlx5_1:1"


async def test_no_map_where_the_node_cannot_tell(tmp_path: Path) -> None:
    cfg = node(tmp_path, ONE_FABRIC)
    inv = await inventory(tmp_path, cfg)
    hcas = ("mlx5_0", "mlx5_1")
    # No inventory, a single-node spec, or HCAs without a PCI address for vLLM's map.
    plain = build_plan(gang_spec((UUID[0],), hcas), cfg, "/w", gpu_indices=INDICES).main.env
    assert not {"UCX_NET_DEVICES", "VLLM_GPU_NIC_PCIE_MAPPING"} & set(plain)
    single = attrs.evolve(gang_spec((UUID[0],), hcas), gang=None)
    env = default_plan(cfg, "py", inventory=lambda: inv)(single, INDICES).main.env
    assert not {"UCX_NET_DEVICES", "VLLM_GPU_NIC_PCIE_MAPPING", "NCCL_IB_HCA"} & set(env)
    bare = attrs.evolve(inv, hcas=tuple(attrs.evolve(h, pci_path=()) for h in inv.hcas))
    env = default_plan(cfg, "py", inventory=lambda: bare)(gang_spec((UUID[0],), hcas), INDICES).main.env
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1" and "VLLM_GPU_NIC_PCIE_MAPPING" not in env


async def test_a_down_hca_gives_way_to_the_next_nearest(tmp_path: Path) -> None:
    inv = await inventory(tmp_path, node(tmp_path, ONE_FABRIC))
    down = tuple(attrs.evolve(h, ports=(attrs.evolve(h.ports[0], state="DOWN"),))
                 if h.name == "mlx5_0" else h for h in inv.hcas)
    nics = for_member(inv.gpus, down, UUID[:2], ("mlx5_0", "mlx5_1"))
    assert [(n.hca, n.link) for n in nics] == [("mlx5_1", "SYS"), ("mlx5_1", "SYS")]


def _hca(name: str, path: tuple[str, ...], numa: int | None) -> Hca:
    return Hca(name, "g", (IbPort(1, "ACTIVE", "LinkUp", 200, "InfiniBand", "fe80"),), path, numa)


async def test_ties_are_spread_and_absent_names_skipped(tmp_path: Path) -> None:
    inv = await inventory(tmp_path, node(tmp_path, ONE_FABRIC))
    # Two HCAs under socket 0's switch: its two GPUs get one each.
    sw = LAYOUT["gpu0"][:4]
    twins = (_hca("mlx5_0", (*sw, "0000:1a:00.0"), 0), _hca("mlx5_2", (*sw, "0000:1a:00.1"), 0))
    nics = nearest_hcas(inv.gpus[:2], twins, ("mlx5_0", "mlx5_2", "mlx5_9"))
    assert [(n.hca, n.link) for n in nics] == [("mlx5_0", "PIX"), ("mlx5_2", "PIX")]
    assert nearest_hcas(inv.gpus, twins, ("mlx5_9",)) == ()
    # Unknown paths: NUMA still says NODE or SYS; nothing known: "".
    blind = (_hca("a", (), 1), _hca("b", (), None))
    assert [n.hca for n in nearest_hcas(inv.gpus[2:3], blind, ("b", "a"))] == ["a"]


async def test_describe_replica_shows_which_gpu_rides_which_hca(tmp_path: Path) -> None:
    inv = await inventory(tmp_path, node(tmp_path, ONE_FABRIC))
    members = (
        Member(node_id="gpu-1", addr="10.0.0.2", port=20001, gpus=(UUID[0], UUID[2]), rank=0,
               hcas=("mlx5_0", "mlx5_1")),
        Member(node_id="gpu-9", addr="10.0.0.9", port=20001, gpus=("GPU-x",), rank=1, hcas=("mlx5_0",)),
    )
    nics = member_nics(members, {"gpu-1": inv})
    assert nics == {"gpu-1": ["GPU 0 -> mlx5_0 (PIX)", "GPU 2 -> mlx5_1 (PIX)"]}
    text = _describe_replica({"id": "r", "deployment": "d", "state": "ready", "nics": nics})
    assert "HCAs:\n  gpu-1: GPU 0 -> mlx5_0 (PIX), GPU 2 -> mlx5_1 (PIX)" in text
    assert "HCAs" not in _describe_replica({"id": "r", "deployment": "d", "state": "ready", "nics": {}})


_PATHS = st.lists(st.sampled_from(["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0",
                                   "0000:02:01.0", "0000:03:00.0"]), min_size=0, max_size=5)


@given(_PATHS, _PATHS, st.sampled_from([None, 0, 1]), st.sampled_from([None, 0, 1]))
def test_link_agrees_with_the_agents_link_kind(a: list[str], b: list[str], na: int | None,
                                               nb: int | None) -> None:
    pa = tuple(a) if len(a) > 1 and a[0].startswith("pci") else ()
    pb = tuple(b) if len(b) > 1 and b[0].startswith("pci") else ()
    ours, agents = link(pa, pb, na, nb), link_kind(pa, pb, na, nb)
    assert ours in TIERS
    if pa and pb:
        assert ours == ("PIX" if agents == "X" else agents)
    else:
        assert agents == "" and ours == ("" if na is None or nb is None else ("NODE" if na == nb else "SYS"))

