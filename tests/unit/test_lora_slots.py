"""More adapters than LoRA slots (issue 23): legal, as the engines take it (at most
max_loras adapters in one batch, the rest wait for a slot), said in the apply's event and
`describe deployment`; vLLM engines keep every adapter in host memory (--max-cpu-loras)
instead of dropping all but max_loras and reading them again from their paths."""

from __future__ import annotations

import pytest
from attrs import evolve

from llmgw.agent.engines.vllm import lora_flags
from llmgw.ctl.render import render
from llmgw.errors import UsageError
from llmgw.model.deployment import Deployment, Member, Replica
from llmgw.model.engine import Adapter, EngineKind
from llmgw.server.reconcile.adapters import apply_note, lora_sharing
from llmgw.simengine.args import parse_args


def adapters(n: int) -> tuple[Adapter, ...]:
    return tuple(Adapter(f"a{i}", f"/adapters/a{i}") for i in range(n))


def dep(n: int, max_loras: int = 0, engine: EngineKind = EngineKind.VLLM) -> Deployment:
    return Deployment(name="llama", model="org/llama", engine=engine, gpus_per_node=1,
                      replicas=1, adapters=adapters(n), max_loras=max_loras)


def test_adapters_within_the_slots_need_no_word() -> None:
    assert lora_sharing(dep(0)) == "" and lora_sharing(dep(0, max_loras=2)) == ""
    assert lora_sharing(dep(4)) == ""  # the default 4 slots
    assert lora_sharing(dep(2, max_loras=2)) == ""


def test_more_adapters_than_slots_is_said_with_the_figures() -> None:
    text = lora_sharing(dep(6, max_loras=2))
    assert text.startswith("6 adapters share 2 LoRA slots per engine (max_loras 2): at most 2 "
                           "of them in one batch, a request for another waits for a slot")
    assert "max_loras unset, 4 by default" in lora_sharing(dep(5))


def test_the_apply_event_says_it_when_adapters_or_slots_change() -> None:
    five = dep(5)
    assert apply_note(None, five).startswith("5 adapters share 4 LoRA slots")
    assert apply_note(None, dep(3)) == ""
    six = evolve(five, adapters=adapters(6))
    note = apply_note(five, six)
    assert note.startswith("adapters now a0, a1, a2, a3, a4, a5: loaded and unloaded on the "
                           "running engines, no restart; 6 adapters share 4 LoRA slots")
    assert apply_note(five, evolve(five, replicas=3)) == ""  # nothing of LoRA changed
    more = apply_note(five, evolve(five, max_loras=2))  # fewer slots: a roll, said anyway
    assert more.startswith("5 adapters share 2 LoRA slots")
    assert apply_note(five, evolve(five, max_loras=8)) == ""  # now they fit


def _flags(d: Deployment) -> tuple[str, ...]:
    r = Replica("llama-0", "llama", 0, d, members=(Member("n1", 0, ("GPU-a",), 20001, "10.0.0.1"),))
    (spec,) = r.engine_specs()
    return lora_flags(spec)


def test_vllm_keeps_every_adapter_in_host_memory() -> None:
    assert _flags(dep(6, max_loras=2)) == ("--enable-lora", "--max-loras", "2", "--max-lora-rank",
                                           "16", "--max-cpu-loras", "6")
    # Within the slots, vLLM's own default (max_cpu_loras = max_loras) already holds them.
    assert _flags(dep(2, max_loras=2)) == ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")
    assert _flags(dep(0)) == ()


def test_the_simulated_engine_takes_the_cpu_cache_as_vllm_does() -> None:
    base = ["serve", "org/m", "--port", "20001", "--enable-lora", "--max-loras", "2"]
    assert parse_args([*base, "--max-cpu-loras", "6"], {}).unknown == ()
    with pytest.raises(UsageError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        parse_args([*base, "--max-cpu-loras", "1"], {})


def test_describe_deployment_shows_the_sharing() -> None:
    d = {"name": "llama", "model": "org/llama", "served_name": "llama", "engine": "vllm",
         "ready": 1, "replicas": 1, "status": "ready", "spec": {}, "replica_list": [],
         "lora": lora_sharing(dep(6, max_loras=2))}
    text = render("describe", "deployment", d)
    assert "\nLoRA:      6 adapters share 2 LoRA slots per engine" in text
    assert "LoRA:" not in render("describe", "deployment", {**d, "lora": ""})
