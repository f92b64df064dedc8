"""A gang whose members hold the model at one path is told so (issue 23), with a real
server and two agents on loopback (fake sysfs HCAs, simulated GPUs and engines): the
server reads both members' scans at placement, and each member's desired set names the
path (GangSpec.weights_path), as its engine record shows. With a member that holds no
copy, no path is named. Which copy a Ray head then starts on is the agent's pure rule
(tests/unit/test_gang_weights.py); the simulated engine is no Ray gang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fakes.live import Cluster, wait_for
from fakes.sysfs import hca_nodes

pytestmark = pytest.mark.slow

GANG = ("name: gang\nmodel: org/gang\nengine: simulated\ngpus_per_node: 1\nnodes: 2\n"
        "replicas: 1\ndrain_timeout: 0s\n")


def _model(root: Path) -> Path:
    d = root / "org" / "gang"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "model.safetensors").write_bytes(b"x" * 64)
    return d


def _gang_of_record(c: Cluster, node: str, rid: str) -> dict[str, Any]:
    path = c.root / "agents" / node / "work" / "engines" / rid / "record.json"
    gang: dict[str, Any] = json.loads(path.read_text())["spec"]["gang"]
    return gang


def _ready(c: Cluster, rid: str) -> None:
    wait_for(lambda: c.replicas().get(rid, {}).get("state") == "ready", 40, f"{rid} ready")


def test_members_holding_one_path_get_it_in_their_specs(cluster: Cluster, tmp_path: Path) -> None:
    # One folder that both agents scan: the same local path on each "node".
    models = tmp_path / "models"
    copy = _model(models)
    nodes = hca_nodes(cluster.root, ("a1", "a2"), ("mlx5_0",), gpus=1, model_dirs=[str(models)])
    cluster.up(nodes)
    cluster.apply("gang", GANG)
    _ready(cluster, "gang-0")
    for node in ("a1", "a2"):
        assert _gang_of_record(cluster, node, "gang-0")["weights_path"] == str(copy)


def test_a_member_without_the_copy_gets_no_path(cluster: Cluster, tmp_path: Path) -> None:
    models = tmp_path / "models"
    _model(models)
    nodes = hca_nodes(cluster.root, ("a1", "a2"), ("mlx5_0",), gpus=1)
    nodes["a1"]["model_dirs"] = [str(models)]
    cluster.up(nodes)
    cluster.apply("gang", GANG)
    _ready(cluster, "gang-0")
    for node in ("a1", "a2"):
        assert _gang_of_record(cluster, node, "gang-0")["weights_path"] == ""
