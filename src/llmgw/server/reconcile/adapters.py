"""LoRA adapters on the server's side: a change the running engines take without a
restart, where each one is loaded (for the routers' table), why one is not, and names
that would collide between deployments.

Pure: data in, data out. The rollout calls `refresh_adapters`; the orchestrator builds
the endpoint table and the apply check from the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from attrs import evolve

from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.model.engine import RUNTIME_ADAPTERS, EngineReport
from llmgw.server.reconcile.passes import Pass


def _names(d: Deployment) -> str:
    return ", ".join(a.name for a in d.adapters) or "none"


def refresh_adapters(p: Pass, d: Deployment) -> None:
    """Replicas whose spec differs from `d` only where no engine restarts (the adapters of
    an engine that loads them at runtime, and what else template_hash leaves out) take
    `d` in place: same generation, so the agent loads and unloads the difference on the
    running engines. An engine that cannot is rolled by the rollout (its hash changed);
    `apply_note` says which happens when the deployment is applied."""
    new_hash = p.hash(d)
    for r in p.mine(d.name):
        if (r.spec.adapters == d.adapters or r.state == ReplicaState.DRAINING
                or p.hash(r.spec) != new_hash):
            continue
        p.put(evolve(r, spec=d))
        p.event(r, f"adapters now {_names(d)}: loaded and unloaded on its running engines "
                   "(no restart)")


def apply_note(old: Deployment | None, new: Deployment) -> str:
    """What a change of adapters does, for the "updated" event of an apply; "" when the
    adapters did not change."""
    if old is None or old.adapters == new.adapters:
        return ""
    what = f"adapters now {_names(new)}"
    if old.template_hash() == new.template_hash():
        return f"{what}: loaded and unloaded on the running engines, no restart"
    if new.engine not in RUNTIME_ADAPTERS:
        return f"{what}: {new.engine} takes adapters only at start, so its replicas are rolled"
    if not new.lora_slots:
        return f"{what}: no adapter left and max_loras unset, so its replicas are rolled without LoRA"
    return (f"{what}: LoRA is switched on, or its limits set, only at an engine's start, so "
            "its replicas are rolled")


def replica_adapters(r: Replica, report: EngineReport | None) -> tuple[str, ...]:
    """The adapters the head engine of `r` has loaded, of those its spec wants (a report
    of another generation says nothing about this one)."""
    if report is None or report.generation != r.generation or not report.adapters:
        return ()
    wanted = {a.name for a in r.spec.adapters}
    return tuple(a for a in report.adapters if a in wanted)


def adapters_waiting(deployments: Mapping[str, Deployment],
                     loaded: Mapping[str, set[str]],
                     errors: Mapping[str, list[str]]) -> dict[str, str]:
    """Adapter name -> why no ready replica has it loaded, for each adapter a deployment
    declares (the routers answer those 503 with the reason, not 404). `loaded`: served
    name -> adapters loaded on its ready replicas; `errors`: adapter -> the engines' reasons."""
    out: dict[str, str] = {}
    for _, d in sorted(deployments.items()):
        if d.replicas == 0:
            continue
        have = loaded.get(d.served_name, set())
        for a in d.adapters:
            if a.name in have:
                continue
            why = errors.get(a.name)
            out[a.name] = (f"adapter of {d.served_name}, not loaded: {why[0]}" if why else
                           f"adapter of {d.served_name}, loaded on no ready replica yet")
    return out


def adapter_errors(reports: Iterable[EngineReport]) -> dict[str, list[str]]:
    """Adapter name -> the reasons engines gave for not loading it ("name: why" lines)."""
    out: dict[str, list[str]] = {}
    for rep in reports:
        for line in rep.adapter_errors:
            name, _, why = line.partition(": ")
            out.setdefault(name, []).append(why)
    return out


def name_conflict(d: Deployment, deployments: Mapping[str, Deployment]) -> str:
    """Why `d` cannot be applied beside the other deployments: one of its adapters is named
    like another's served name or adapter, or its served name like another's adapter (a
    request naming it could not tell which is meant); "" when none."""
    mine = {a.name for a in d.adapters}
    for other in deployments.values():
        if other.name == d.name:
            continue
        theirs = {a.name for a in other.adapters}
        clash = sorted(mine & ({other.served_name} | theirs))
        if clash:
            return (f"adapter {clash[0]!r} is already a model or adapter name of deployment "
                    f"{other.name!r}")
        if d.served_name in theirs:
            return f"served name {d.served_name!r} is an adapter of deployment {other.name!r}"
    return ""
