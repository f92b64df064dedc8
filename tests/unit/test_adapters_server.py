"""The server's side of LoRA adapters: a change that running vLLM engines take is applied
to their replicas in place (same generation, new desired sets), one that SGLang cannot
take rolls; the endpoint rows and waiting reasons; names that collide between deployments."""

from __future__ import annotations

from attrs import evolve

from fakes.cluster import cluster, node
from llmgw.model.deployment import Deployment, ReplicaState
from llmgw.model.engine import Adapter, EngineKind, EngineReport, EngineState
from llmgw.server.reconcile import adapters
from llmgw.server.reconcile.rules import desired_sets, reconcile

SQL, CHAT = Adapter("m-sql", "/a/sql"), Adapter("m-chat", "/a/chat")


def dep(engine: EngineKind = EngineKind.VLLM, **kw: object) -> Deployment:
    return Deployment(name="d", model="org/m", engine=engine, gpus_per_node=1, replicas=2,
                      served_name="m", adapters=(SQL,), **kw)  # type: ignore[arg-type]


def _ready(replicas: dict) -> dict[str, list[EngineReport]]:
    out: dict[str, list[EngineReport]] = {}
    for r in replicas.values():
        for m in r.members:
            out.setdefault(m.node_id, []).append(
                EngineReport(r.id, r.generation, EngineState.READY))
    return out


def _run(engine: EngineKind) -> tuple[dict, object]:
    nodes = cluster(node("a", 1), node("b", 1), node("c", 1), node("e", 1))
    d = dep(engine)
    res = reconcile({"d": d}, {}, nodes, {}, 1000.0)
    res = reconcile({"d": d}, res.replicas, nodes, _ready(res.replicas), 1001.0,
                    generation_floor=res.generation_floor)
    before = res.replicas
    assert {r.state for r in before.values()} == {ReplicaState.READY}
    d2 = evolve(d, adapters=(SQL, CHAT))
    res = reconcile({"d": d2}, before, nodes, _ready(before), 1002.0,
                    generation_floor=res.generation_floor)
    return before, res


def test_vllm_replicas_take_new_adapters_in_place() -> None:
    before, res = _run(EngineKind.VLLM)
    after = res.replicas  # type: ignore[attr-defined]
    assert set(after) == set(before)
    for rid, r in after.items():
        assert r.generation == before[rid].generation and r.members == before[rid].members
        assert r.spec.adapters == (SQL, CHAT)
    # The nodes get their desired sets again: same generation, the new adapters.
    assert res.changed_nodes == {m.node_id for r in after.values() for m in r.members}  # type: ignore[attr-defined]
    for specs in desired_sets(after.values()).values():
        assert all(s.adapters == (SQL, CHAT) and s.max_loras == 4 for s in specs)
    assert sum("no restart" in e.text for e in res.events) == 2  # type: ignore[attr-defined]


def test_sglang_replicas_are_rolled_instead() -> None:
    before, res = _run(EngineKind.SGLANG)
    after = res.replicas  # type: ignore[attr-defined]
    surge = [r for r in after.values() if r.replaces]
    assert surge and surge[0].spec.adapters == (SQL, CHAT) and surge[0].id not in before
    assert all(after[rid].spec.adapters == (SQL,) for rid in before)  # the old ones unchanged


def test_apply_notes_say_which() -> None:
    v = dep()
    assert "no restart" in adapters.apply_note(v, evolve(v, adapters=(SQL, CHAT)))
    s = dep(EngineKind.SGLANG)
    assert "sglang takes adapters only at start" in adapters.apply_note(s, evolve(s, adapters=()))
    off = evolve(v, adapters=())
    assert "rolled" in adapters.apply_note(off, v)
    assert adapters.apply_note(None, v) == "" and adapters.apply_note(v, v) == ""


def test_the_head_reports_which_adapters_are_loaded() -> None:
    before, _ = _run(EngineKind.VLLM)
    r = next(iter(before.values()))
    rep = EngineReport(r.id, r.generation, EngineState.READY, adapters=("m-sql", "gone"))
    assert adapters.replica_adapters(r, rep) == ("m-sql",)  # only what the spec still wants
    assert adapters.replica_adapters(r, evolve(rep, generation=r.generation + 1)) == ()
    assert adapters.replica_adapters(r, None) == ()


def test_declared_but_not_loaded_adapters_wait_with_a_reason() -> None:
    d = evolve(dep(), adapters=(SQL, CHAT))
    errors = adapters.adapter_errors([EngineReport("d-0", 1, EngineState.READY,
                                                   adapter_errors=("m-chat: No adapter found for /a/chat",))])
    waiting = adapters.adapters_waiting({"d": d}, {"m": {"m-sql"}}, errors)
    assert waiting == {"m-chat": "adapter of m, not loaded: No adapter found for /a/chat"}
    assert "loaded on no ready replica" in adapters.adapters_waiting({"d": d}, {}, {})["m-sql"]


def test_names_that_collide_between_deployments() -> None:
    llama = dep()
    qwen = Deployment(name="q", model="org/q", engine=EngineKind.VLLM, gpus_per_node=1, replicas=1,
                      served_name="qwen")
    assert adapters.name_conflict(llama, {"q": qwen}) == ""
    clash = evolve(llama, adapters=(Adapter("qwen", "/a/q"),))
    assert "already a model or adapter name of deployment 'q'" in adapters.name_conflict(clash, {"q": qwen})
    other = evolve(qwen, adapters=(Adapter("m-sql", "/x"),))
    assert "'m-sql'" in adapters.name_conflict(llama, {"q": other})
    assert "is an adapter of deployment 'd'" in adapters.name_conflict(evolve(qwen, served_name="m-sql"),
                                                                      {"d": llama})
    assert adapters.name_conflict(llama, {"d": llama}) == ""  # itself, updated
