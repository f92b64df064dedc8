"""State rebuilt from the cluster: engines the nodes run that the server has no record of.

A server whose state folder was lost (or restored from an old copy) must not stop engines
it did not start. Every engine record carries the deployment it was made from
(EngineSpec.origin) and the id of the state that issued it (EngineSpec.issuer), and each
Hello sends them back. An engine the server does not know that another state issued, or
whose generation is above this state's floor (a copy restored from before it), cannot have
been stopped on purpose by this state, so it is adopted: its replica is born placed where
it runs (the lifecycle's ADOPTED birth), and its deployment from the origin when the
server has none by that name. Pure: data in, data out.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import evolve, frozen

from llmgw.config.deployment import parse_deployment
from llmgw.errors import DeploymentError
from llmgw.model.deployment import Deployment, Member, Replica
from llmgw.model.engine import EngineReport, EngineSpec
from llmgw.server.reconcile.replica_states import ENGINE_ENDED, ReplicaEvent, next_state


@frozen
class Rebuilt:
    deployments: dict[str, Deployment]  # every deployment, with those rebuilt
    replicas: dict[str, Replica]  # every replica, with those adopted
    generation_floor: int
    adopted: tuple[str, ...] = ()  # replica ids
    created: tuple[str, ...] = ()  # deployment names rebuilt from engine records
    waiting: frozenset[str] = frozenset()  # nodes with a gang member whose peers are unheard
    notes: tuple[str, ...] = ()  # engine records that could not be used, and why


def adoptable(report: EngineReport, replicas: Mapping[str, Replica], floor: int, state_id: str) -> bool:
    spec = report.spec
    if spec is None or report.replica_id in replicas:
        return False
    if report.state in ENGINE_ENDED:
        return False
    return report.generation > floor or bool(spec.issuer) and spec.issuer != state_id


def rebuild(
    deployments: Mapping[str, Deployment],
    replicas: Mapping[str, Replica],
    reports: Mapping[str, tuple[EngineReport, ...]],
    addrs: Mapping[str, str],
    floor: int,
    now: float,
    rebuilt: frozenset[str] = frozenset(),
    state_id: str = "",
) -> Rebuilt:
    """`reports`: node id -> the engines it reported at Hello; `addrs`: node id -> its
    management address; `rebuilt`: deployments rebuilt earlier, whose replica count still
    follows what is adopted (nodes say Hello one by one)."""
    deps = dict(deployments)
    reps = dict(replicas)
    groups: dict[tuple[str, int], list[tuple[str, EngineSpec]]] = {}
    for node_id, rs in sorted(reports.items()):
        for rep in rs:
            if adoptable(rep, replicas, floor, state_id) and rep.spec is not None:
                groups.setdefault((rep.replica_id, rep.generation), []).append((node_id, rep.spec))
    adopted: list[str] = []
    created: list[str] = []
    notes: list[str] = []
    waiting: set[str] = set()
    top = floor
    # Where one replica id is reported at two generations, the newest is the one to keep.
    for (rid, gen), members in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        if rid in reps:
            continue
        spec = members[0][1]
        nnodes = spec.gang.nnodes if spec.gang is not None else 1
        if len(members) < nnodes:
            waiting.update(n for n, _ in members)
            continue
        try:
            origin = parse_deployment(spec.origin, f"the engine record of {rid}")
        except DeploymentError as exc:
            notes.append(f"{rid}: not adopted: {exc}")
            continue
        name = origin.name
        index = _index(rid, name)
        if index is None:
            notes.append(f"{rid}: not adopted: its id does not name deployment {name!r}")
            continue
        d = deps.get(name)
        if d is None or name in rebuilt or name in created:
            count = 1 + sum(1 for r in reps.values() if r.deployment == name)
            d = evolve(origin, replicas=max(count, d.replicas if d else 0))
            deps[name] = d
            if name not in created:
                created.append(name)
        ms = sorted(members, key=lambda m: m[1].gang.rank if m[1].gang else 0)
        reps[rid] = Replica(
            id=rid, deployment=name, index=index, spec=origin, generation=gen,
            members=tuple(_member(n, s, addrs.get(n, "")) for n, s in ms),
            gang_weights=_gang_weights(ms[0][1]),
            state=next_state(None, ReplicaEvent.ADOPTED),
            reason="adopted: rebuilt from the engine it runs",
            placed_at=now,
        )
        adopted.append(rid)
        top = max(top, gen)
    return Rebuilt(deps, reps, top, tuple(adopted), tuple(created), frozenset(waiting), tuple(notes))


def _index(rid: str, deployment: str) -> int | None:
    prefix = f"{deployment}-"
    tail = rid[len(prefix):] if rid.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and len(tail) < 7 else None


def _gang_weights(head: EngineSpec) -> str:
    """The common copy the head's spec names, kept so the rebuilt specs equal the ones
    that run."""
    return head.gang.weights_path if head.gang is not None else ""


def _member(node_id: str, s: EngineSpec, addr: str) -> Member:
    g = s.gang
    return Member(
        node_id=node_id, rank=g.rank if g else 0, gpus=s.gpus, port=s.port, port_base=s.port_base, addr=addr,
        rendezvous_port=g.rendezvous_port if g else 0, ray_port=g.ray_port if g else 0,
        ray_port_base=g.ray_port_base if g else 0, hcas=g.hcas if g else (),
    )
