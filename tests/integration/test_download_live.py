"""Downloads shown and bounded by space (issue 23), with real server and agent processes
and the simulated engine: a node whose download_dir has less free space than another
node's copy of the model takes is not given a replica that would download there, and
says why; a replica whose engine downloads shows the bytes on disk in `describe replica`
and the status document. The download is the test's own writes into the cache layout
(the simulated engine fetches nothing); free space is the real file system's, and the
copy's size a sparse file's, so no disk is filled."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fakes.live import Cluster, wait_for
from fakes.nvidia_smi import L40S, L40S_BUS, query_line, topo_matrix, write_script

TIB = 2**40


def _idle_gpu(folder: Path) -> Path:
    return write_script(folder, query_line(0, L40S, L40S_BUS[0], 46068, 46068, "8.9") + "\n",
                        topo_matrix([["X"]], ["0"]))


def _sparse_model(root: Path, name: str, size: int) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(size)  # a hole: its size, none of the disk


def _big_on_two_nodes(cluster: Cluster, tmp_path: Path, models: Path) -> None:
    """n1 holds org/big under `models` (download_dir dl1), n2 holds nothing (dl2); two
    replicas of it applied."""
    cluster.start_server()
    cluster.start_agent("n1", discovery={"nvidia_smi": str(_idle_gpu(tmp_path / "smi1"))},
                        model_dirs=[str(models)], download_dir=str(tmp_path / "dl1"))
    cluster.start_agent("n2", discovery={"nvidia_smi": str(_idle_gpu(tmp_path / "smi2"))},
                        download_dir=str(tmp_path / "dl2"))
    cluster.wait_states({"n1": "ready", "n2": "ready"})
    dep = tmp_path / "big.yaml"
    dep.write_text("name: big\nmodel: org/big\nengine: simulated\ngpus_per_node: 1\nreplicas: 2\n")
    assert cluster.ctl("apply", "-f", str(dep)).returncode == 0


def test_a_node_short_of_space_is_refused_with_the_reason(cluster: Cluster, tmp_path: Path) -> None:
    if os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize >= TIB:
        pytest.skip("a file system with a TiB free: the copy below would fit")
    models = tmp_path / "models"
    _sparse_model(models, "org/big", TIB)
    _big_on_two_nodes(cluster, tmp_path, models)
    want = f"n2: download_dir {tmp_path / 'dl2'} has "  # the whole path, for the operator

    def refused() -> str | None:
        text = json.dumps(cluster.status())
        return text if want in text else None

    text = wait_for(refused, 30, "the second replica refused for space", interval=0.5)
    assert "the model needs 1024 GiB" in text
    assert "lacked 1024 GiB free in download_dir for the model" in text
    node = cluster.ctl("describe", "node", "n2").stdout
    assert f"Downloads: {tmp_path / 'dl2'} (" in node and "GiB free)" in node, node
    replicas = {r["id"]: r for r in cluster.status()["replicas"]}
    assert [m for r in replicas.values() for m in r["nodes"]] == ["n1"]


def test_a_download_under_way_there_is_room_of_its_own(cluster: Cluster, tmp_path: Path) -> None:
    # n2 already has most of org/big in its download_dir (a download cut short, or another
    # replica's under way): only the rest must fit, so the second replica goes there.
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    if free >= TIB:
        pytest.skip("a file system with a TiB free: the copy below would fit anyway")
    models = tmp_path / "models"
    _sparse_model(models, "org/big", TIB)
    blobs = tmp_path / "dl2" / "models--org--big" / "blobs"
    blobs.mkdir(parents=True)
    with open(blobs / "abc.incomplete", "wb") as f:
        f.truncate(TIB - free // 2)  # a hole: the rest is half of what is free
    _big_on_two_nodes(cluster, tmp_path, models)

    def placed() -> list[str] | None:
        nodes = sorted(m for r in cluster.status()["replicas"] for m in r["nodes"])
        return nodes if nodes == ["n1", "n2"] else None

    wait_for(placed, 30, "both replicas placed, the second on n2", interval=0.5)


def test_a_download_shows_in_describe_and_status(cluster: Cluster, tmp_path: Path) -> None:
    dl = tmp_path / "dl"
    cluster.start_server()
    cluster.start_agent("n1", discovery={"nvidia_smi": str(_idle_gpu(tmp_path / "smi"))},
                        download_dir=str(dl))
    cluster.wait_states({"n1": "ready"})
    dep = tmp_path / "tiny.yaml"
    dep.write_text("name: tiny\nmodel: org/tiny\nengine: simulated\ngpus_per_node: 1\n"
                   "replicas: 1\nenv: {LLMGW_SIM_LOAD_SECONDS: '120'}\n")
    assert cluster.ctl("apply", "-f", str(dep)).returncode == 0
    blobs = dl / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc.incomplete").write_bytes(b"x" * 3_000_000)

    def rows() -> list[dict[str, object]]:
        return [r for r in cluster.status()["replicas"] if r.get("download")]

    (row,) = wait_for(rows, 30, "the download in the status document", interval=0.5)
    assert str(row["download"]).startswith("{'n1': '3.0 MB on disk")
    described = cluster.ctl("describe", "replica", "tiny-0").stdout
    assert "Download:   3.0 MB on disk" in described and "(on n1)" in described, described
