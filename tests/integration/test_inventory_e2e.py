"""Discovery end to end: two agents on loopback with different fake inventories, one
shared store seen by both, and ctl status showing what each fabric can serve."""

from __future__ import annotations

from pathlib import Path

from fakes.live import Cluster, wait_for
from fakes.models import plain_model
from fakes.nvidia_smi import nvlink_board, pcie_box
from fakes.sysfs import add_hca


def test_two_agents_one_shared_store_counted_once(cluster: Cluster, tmp_path: Path) -> None:
    filer = tmp_path / "filer"
    plain_model(filer, "meta/llama-70b")
    local = tmp_path / "local-b"
    plain_model(local, "qwen/qwen-7b")
    plain_model(local, "broken/half", missing_shard=1)
    ib_a, ib_b = tmp_path / "ib-a", tmp_path / "ib-b"
    for root in (ib_a, ib_b):
        root.mkdir()
        add_hca(root, "mlx5_0")
        add_hca(root, "mlx5_1", states=("DOWN",))
    shared = {"path": str(filer), "shared": True, "store": "filer-1"}
    cluster.start_server()
    cluster.start_agent(
        "gpu-a-01",
        discovery={"nvidia_smi": str(nvlink_board(tmp_path / "smi-a")), "ib_root": str(ib_a)},
        fabrics=[{"name": "ib-a", "hcas": ["mlx5_0"]}],
        model_dirs=[shared],
    )
    cluster.start_agent(
        "gpu-a-02",
        discovery={"nvidia_smi": str(pcie_box(tmp_path / "smi-b")), "ib_root": str(ib_b)},
        fabrics=[{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}],
        model_dirs=[shared, str(local)],
    )
    cluster.start_agent("island-01")  # no fabrics, never asked to look
    cluster.wait_states({"gpu-a-01": "ready", "gpu-a-02": "ready", "island-01": "ready"})
    st = cluster.status()
    nodes = {n["id"]: n for n in st["nodes"]}

    a1 = nodes["gpu-a-01"]
    assert a1["gpu_source"] == "nvidia-smi" and len(a1["gpus"]) == 8
    peers = a1["gpus"][0]["nvlink_peers"]
    assert len(peers) == 7 and set(peers.values()) == {18}
    assert {"uuid", "index", "name", "memory_total", "nvlink_peers"} <= set(a1["gpus"][0])
    assert [(f["name"], f["state"]) for f in a1["fabrics"]] == [("ib-a", "up")]
    assert [(f["name"], f["state"]) for f in nodes["gpu-a-02"]["fabrics"]] == [("ib-a", "degraded")]
    assert nodes["island-01"]["storage"] == {"asked": False}
    models_b = {m["name"]: m for m in nodes["gpu-a-02"]["storage"]["models"]}
    assert models_b["broken/half"]["complete"] is False
    assert models_b["meta/llama-70b"]["shared"] is True and models_b["meta/llama-70b"]["store"] == "filer-1"
    assert models_b["qwen/qwen-7b"]["shared"] is False

    (fabric,) = st["fabrics"]
    assert fabric["name"] == "ib-a" and sorted(fabric["nodes"]) == ["gpu-a-01", "gpu-a-02"]
    served = {m["name"]: m for m in fabric["models"]}
    # One filer seen by two nodes counts once; the half download counts for nothing.
    assert served["meta/llama-70b"]["shared_stores"] == ["filer-1"]
    assert served["meta/llama-70b"]["local_nodes"] == []
    assert served["qwen/qwen-7b"] == {"name": "qwen/qwen-7b", "shared_stores": [],
                                       "local_nodes": ["gpu-a-02"]}
    assert "broken/half" not in served
    assert st["islands"] == ["island-01"]

    table = cluster.ctl("status").stdout
    assert "meta/llama-70b (shared store filer-1)" in table
    assert "qwen/qwen-7b (local copy on 1 node)" in table
    assert "islands (no fabric, single-node replicas only): island-01" in table


def test_rediscover_on_demand_reports_a_new_model(cluster: Cluster, tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    cluster.start_server()
    cluster.start_agent("gpu-a-01", model_dirs=[str(store)])
    cluster.wait_states({"gpu-a-01": "ready"})
    storage = cluster.status()["nodes"][0]["storage"]
    assert storage["asked"] is True and storage["models"] == []
    # download_dir by default is the first model_dirs entry (issue 23), with its space.
    assert storage["download_dir"] == str(store) and storage["download_free"] > 0
    plain_model(store, "org/fresh")
    r = cluster.ctl("rediscover", "gpu-a-01")
    assert r.returncode == 0 and "asked gpu-a-01" in r.stdout
    wait_for(lambda: [m["name"] for m in cluster.status()["nodes"][0]["storage"]["models"]]
             == ["org/fresh"], 10, "the new model reported")
    assert cluster.ctl("rediscover", "nobody").returncode == 1
