"""LoRA adapters in a deployment: validated once by the deployment validator, carried to
the engine specs, and rolling only the engines that cannot load them at runtime."""

from __future__ import annotations

from typing import Any

import pytest
from attrs import evolve

from llmgw.config.deployment import parse_deployment
from llmgw.errors import DeploymentError
from llmgw.model.deployment import Member, Replica
from llmgw.model.engine import Adapter, EngineKind

BASE: dict[str, Any] = {"name": "llama", "model": "org/llama", "engine": "vllm",
                        "gpus_per_node": 1, "replicas": 1, "served_name": "llama"}
SQL = {"name": "llama-sql", "path": "/models/adapters/sql/"}


def test_adapters_parse_travel_and_reach_the_engine_spec() -> None:
    d = parse_deployment({**BASE, "adapters": [SQL], "max_lora_rank": 32}, "x.yaml")
    assert d.adapters == (Adapter("llama-sql", "/models/adapters/sql"),)
    assert (d.lora_slots, d.max_lora_rank) == (4, 32)
    assert parse_deployment(d.plain(), "wire") == d  # plain() is the wire and store shape
    r = Replica("llama-0", "llama", 0, d, members=(Member("n1", 0, ("GPU-a",), 20001, "10.0.0.1"),))
    (spec,) = r.engine_specs()
    assert (spec.adapters, spec.max_loras, spec.max_lora_rank) == (d.adapters, 4, 32)
    plain = parse_deployment(BASE, "x.yaml")
    assert "adapters" not in plain.plain() and plain.lora_slots == 0


@pytest.mark.parametrize(
    ("adapters", "field", "words"),
    [
        ([{"name": "a", "path": "models/a"}], "adapters[0].path", "absolute path"),
        ([{"name": "a", "path": "/m/a"}, {"name": "a", "path": "/m/b"}], "adapters[1].name",
         "names two adapters"),
        ([{"name": "llama", "path": "/m/a"}], "adapters[0].name", "served name"),
        ([{"name": "org/llama", "path": "/m/a"}], "adapters[0].name", "model"),
        ([{"name": "a b", "path": "/m/a"}], "adapters[0].name", "expected a name"),
        ([{"name": "a=b", "path": "/m/a"}], "adapters[0].name", "expected a name"),
        ([{"name": "a"}], "adapters[0].path", "missing"),
        ([{"name": "a", "path": "/m/a", "rank": 8}], "adapters[0].rank", "unknown field"),
        (["a"], "adapters[0]", "expected a mapping"),
        ({"name": "a"}, "adapters", "expected a list"),
    ],
)
def test_bad_adapters_are_one_line_naming_the_field(adapters: Any, field: str, words: str) -> None:
    with pytest.raises(DeploymentError) as info:
        parse_deployment({**BASE, "adapters": adapters}, "deploy/llama.yaml")
    err = info.value
    assert err.key == field and words in str(err), str(err)
    assert "\n" not in str(err) and str(err).startswith(f"deploy/llama.yaml: {field}: ")


@pytest.mark.parametrize(("key", "value"), [("max_loras", 0), ("max_loras", True),
                                            ("max_lora_rank", 12), ("max_lora_rank", "16")])
def test_bad_lora_limits(key: str, value: Any) -> None:
    with pytest.raises(DeploymentError) as info:
        parse_deployment({**BASE, key: value}, "x.yaml")
    assert info.value.key == key


def test_adapters_roll_only_engines_that_cannot_load_them_at_runtime() -> None:
    one = parse_deployment({**BASE, "adapters": [SQL]}, "x.yaml")
    two = evolve(one, adapters=(*one.adapters, Adapter("llama-chat", "/models/adapters/chat")))
    # vLLM (and the simulated engine) load and unload them while running: no roll.
    assert one.template_hash() == two.template_hash()
    for kind in (EngineKind.SIMULATED,):
        assert evolve(one, engine=kind).template_hash() == evolve(two, engine=kind).template_hash()
    # SGLang gets them at start (--lora-paths): a change rolls.
    assert evolve(one, engine=EngineKind.SGLANG).template_hash() != evolve(
        two, engine=EngineKind.SGLANG).template_hash()
    # LoRA itself and its limits are fixed at start: turning it on or changing them rolls.
    none = parse_deployment(BASE, "x.yaml")
    assert none.template_hash() != one.template_hash()
    assert evolve(one, max_lora_rank=64).template_hash() != one.template_hash()
    # With max_loras set, LoRA stays on without adapters: the last one can go without a roll.
    kept = parse_deployment({**BASE, "adapters": [SQL], "max_loras": 2}, "x.yaml")
    assert evolve(kept, adapters=()).template_hash() == kept.template_hash()


def test_a_deployment_without_adapters_keeps_its_hash() -> None:
    # Every hash from before adapters stands: upgrading the server rolls nothing.
    assert parse_deployment(BASE, "x.yaml").template_hash() == "940fd23d55d41d5f"
