"""Deployment files: the examples load; every mistake names the file, field and value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmgw.config.deployment import parse_deployment
from llmgw.config.load_deployment import load_deployment
from llmgw.errors import DeploymentError
from llmgw.model.deployment import Deployment, Strategy
from llmgw.model.engine import EngineKind

CONF = Path(__file__).resolve().parents[2] / "conf" / "deployments"

BASE: dict[str, Any] = {
    "name": "llama",
    "model": "org/llama",
    "engine": "vllm",
    "gpus_per_node": 8,
    "replicas": 2,
}


def test_examples_load() -> None:
    files = sorted(CONF.glob("*.yaml"))
    assert {f.name for f in files} >= {"demo.yaml"}
    loaded = {f.name: load_deployment(str(f)) for f in files}
    demo = loaded["demo.yaml"]
    assert demo.model == "llmgw/sim-tiny" and demo.served_name == "llmgw/sim-tiny"
    assert demo.engine == EngineKind.SIMULATED and demo.gpus_per_node == 1
    assert demo.replicas == 2 and demo.startup_timeout == 60.0
    assert any(d.nodes == 2 for d in loaded.values())
    assert any(d.engine == EngineKind.SGLANG for d in loaded.values())
    auto = loaded["llama-8b-autoscale.yaml"].autoscale
    assert auto is not None and (auto.min, auto.max, auto.idle_to_zero) == (0, 8, 1800.0)
    assert loaded["llama-8b-autoscale.yaml"].priority == 5


def test_defaults() -> None:
    d = parse_deployment(BASE, "x.yaml")
    assert d == Deployment(
        name="llama", model="org/llama", engine=EngineKind.VLLM, gpus_per_node=8, replicas=2
    )
    assert d.served_name == "org/llama" and d.nodes == 1 and d.strategy == Strategy.SPREAD
    assert d.startup_timeout == 600.0 and d.gpu_memory_min == 0


def test_all_fields() -> None:
    d = parse_deployment(
        {
            **BASE,
            "served_name": "llama",
            "nodes": 2,
            "gpu_memory_min": 40000,
            "selector": {"pool": "a"},
            "args": ["--x", 1],
            "env": {"A": 1},
            "startup_timeout": "10m",
            "strategy": "pack",
        },
        "x.yaml",
    )
    assert d.served_name == "llama" and d.nodes == 2 and d.gpu_memory_min == 40000
    assert d.selector == {"pool": "a"} and d.args == ("--x", "1") and d.env == {"A": "1"}
    assert d.startup_timeout == 600.0 and d.strategy == Strategy.PACK
    assert parse_deployment({**BASE, "startup_timeout": "600s"}, "x").startup_timeout == 600.0
    assert parse_deployment({**BASE, "startup_timeout": 30}, "x").startup_timeout == 30.0


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"gpus_per_node": 0}, "gpus_per_node", "got 0"),
        ({"engine": "trt"}, "engine", "'trt'"),
        ({"replicas": -1}, "replicas", "got -1"),
        ({"nodes": 0}, "nodes", "got 0"),
        ({"startup_timeout": "10 minutes"}, "startup_timeout", "10 minutes"),
        ({"startup_timeout": "5"}, "startup_timeout", "no unit"),
        ({"strategy": "binpack"}, "strategy", "'binpack'"),
        ({"replicas": "2"}, "replicas", "'2'"),
        ({"gpus_per_node": True}, "gpus_per_node", "true"),
        ({"name": "Bad Name"}, "name", "'Bad Name'"),
        ({"selector": ["a"]}, "selector", "['a']"),
        ({"env": {"A": None}}, "env.A", "null"),
        ({"args": "--x"}, "args", "'--x'"),
        ({"gpu_memory_min": -5}, "gpu_memory_min", "got -5"),
        ({"replica": 3}, "replica", "unknown field"),
    ],
)
def test_errors_name_file_field_value(change: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(DeploymentError) as info:
        parse_deployment({**BASE, **change}, "deploy/llama.yaml")
    err = info.value
    assert err.path == "deploy/llama.yaml" and err.key == field
    assert words in str(err)
    assert str(err).startswith(f"deploy/llama.yaml: {field}: ")
    assert err.exit_code == 2


def test_missing_required_and_not_a_mapping() -> None:
    data = dict(BASE)
    del data["model"]
    with pytest.raises(DeploymentError, match="model: missing"):
        parse_deployment(data, "x.yaml")
    with pytest.raises(DeploymentError, match="expected a mapping"):
        parse_deployment(["a"], "x.yaml")


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(DeploymentError, match="cannot read"):
        load_deployment(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(DeploymentError, match="not valid YAML"):
        load_deployment(str(bad))
    typo = tmp_path / "typo.yaml"
    typo.write_text("name: a\nmodel: m\nengine: vllm\ngpus_per_node: 1\nreplicas: 1\nnode: 2\n")
    with pytest.raises(DeploymentError) as info:
        load_deployment(str(typo))
    assert info.value.path == str(typo) and info.value.key == "node"


def test_zero_replicas_is_allowed() -> None:
    assert parse_deployment({**BASE, "replicas": 0}, "x").replicas == 0
