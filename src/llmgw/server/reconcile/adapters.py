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


def lora_sharing(d: Deployment) -> str:
    """How `d`'s adapters share its engines' LoRA slots, when they are more than the slots
    (max_loras: adapters in one batch, fixed at an engine's start); "" otherwise.

    Slots are per engine, not per node or GPU: each replica's engine has its own, so
    placement has nothing to count across replicas. More adapters than slots is what
    multi-LoRA serving is for, not an error: vLLM's scheduler keeps at most max_loras
    adapters in a batch and holds a request for another until a slot frees; SGLang the
    same with --max-loras-per-batch (one more, for the base). Every adapter stays loaded
    in host memory (vLLM with --max-cpu-loras, SGLang by default) and is swapped into a
    slot when a batch wants it. What an operator must know is the throughput: at most
    max_loras adapters are served at once per replica."""
    n, slots = len(d.adapters), d.lora_slots
    if not slots or n <= slots:
        return ""
    how = f"max_loras {slots}" if d.max_loras else f"max_loras unset, {slots} by default"
    return (f"{n} adapters share {slots} LoRA slot{'s' if slots != 1 else ''} per engine "
            f"({how}): at most {slots} of "
            "them in one batch, a request for another waits for a slot; all stay loaded in "
            "host memory and are swapped in per batch (set max_loras for more slots, each "
            "taking GPU memory; a change rolls the replicas)")


def apply_note(old: Deployment | None, new: Deployment) -> str:
    """What a change of adapters does, for the "updated" event of an apply, and how the
    adapters share the slots where they are more (lora_sharing); "" when the adapters and
    the slots did not change, or for a new deployment whose adapters fit its slots."""
    sharing = lora_sharing(new)
    if old is not None and (old.adapters, old.lora_slots) == (new.adapters, new.lora_slots):
        sharing = ""
    change = _change_note(old, new)
    return "; ".join(x for x in (change, sharing) if x)


def _change_note(old: Deployment | None, new: Deployment) -> str:
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
