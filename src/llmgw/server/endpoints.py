"""The endpoint table the routers poll (`EndpointsOp`), as plain data: each served name's
routable replicas, the names that may scale to zero and have nothing ready (`cold`), and
why each other name serves nothing (`waiting`). Pure: deployments, replicas, the pending
reasons and the node table in, the table out. The version a router sees is kept by the
op that answers it (ops.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from llmgw.config.vllm_serve import takes_priority
from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.model.engine import EngineReport
from llmgw.model.inventory import NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.reconcile import adapters, sleeping
from llmgw.server.reconcile.replica_states import ROUTABLE


class NodeSide(Protocol):
    """What the table reads of a node (peers/sessions.py's Node has it): read here, never
    copied, since routers poll every second and the node table may hold 50,000."""

    @property
    def state(self) -> NodeState: ...

    @property
    def engines(self) -> Mapping[str, EngineReport]: ...

    @property
    def info(self) -> NodeInfo: ...  # its kv_relay: where its agent relays KV events

    @property
    def key(self) -> str: ...  # the node's public key (z85), its relay's too; "": not known


def table(deployments: Mapping[str, Deployment], replicas: Mapping[str, Replica],
          pending: Mapping[str, str], nodes: Mapping[str, NodeSide]) -> dict[str, Any]:
    """What a router gets, less the version: `models`, `waiting`, and `cold` only when
    there are some (a router from before cold names reads the rest as it did)."""
    rows = _rows(replicas, nodes)
    out: dict[str, Any] = {"models": _strip(rows),
                           "waiting": waiting(deployments, replicas, pending, nodes, rows)}
    names = cold(deployments, replicas)
    if names:
        out["cold"] = names
        for name in names:
            out["waiting"].pop(name, None)
    return out


def cold(deployments: Mapping[str, Deployment], replicas: Mapping[str, Replica]) -> list[str]:
    """Served names of deployments that may scale to zero and have nothing ready
    (at zero, or waking): routers hold their requests rather than refuse them."""
    ready = {r.spec.served_name for r in replicas.values() if sleeping.serving(r)}
    return sorted(d.served_name for d in deployments.values()
                  if d.autoscale is not None and d.autoscale.min == 0
                  and d.served_name not in ready)


def waiting(deployments: Mapping[str, Deployment], replicas: Mapping[str, Replica],
            pending: Mapping[str, str], nodes: Mapping[str, NodeSide],
            rows: Mapping[str, list[dict[str, Any]]] | None = None) -> dict[str, str]:
    """Served name -> why nothing of it is ready, for each deployment that serves
    nothing: the router answers those 503 (with the reason), not 404. `rows`: the
    table's rows (_rows), where the caller has them already."""
    ready = {r.spec.served_name for r in replicas.values() if sleeping.serving(r)}
    out: dict[str, str] = {}
    for name, d in sorted(deployments.items()):
        if d.served_name in ready or d.replicas == 0:
            continue
        mine = [r for r in replicas.values() if r.deployment == name]
        out[d.served_name] = not_ready_reason(d, mine, pending)
    if any(d.adapters for d in deployments.values()):
        loaded: dict[str, set[str]] = {}
        for entries in (_rows(replicas, nodes) if rows is None else rows).values():
            for e in entries:
                if e["ready"]:
                    loaded.setdefault(e["served"], set()).update(e.get("adapters", ()))
        errors = adapters.adapter_errors(
            rep for n in nodes.values() for rep in n.engines.values())
        for name, why in adapters.adapters_waiting(deployments, loaded, errors).items():
            out.setdefault(name, why)
    return out


def not_ready_reason(d: Deployment, mine: Iterable[Replica], pending: Mapping[str, str]) -> str:
    """Why a deployment serves nothing, for a client's 503: `llama-70b: 0 of 2 replicas
    ready (1 starting, 1 pending: 0/3 nodes fit: 3 lacked 8 free GPUs)`."""
    slots = [r for r in mine if not r.replaces]
    counts: dict[str, int] = {}
    for r in slots:
        counts[str(r.state)] = counts.get(str(r.state), 0) + 1
    parts = []
    for state, n in sorted(counts.items()):
        part = f"{n} {state}"
        if state == ReplicaState.PENDING:
            why = sorted({pending[r.id] for r in slots if r.id in pending})
            if why:
                part += ": " + "; ".join(why)
        parts.append(part)
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"{d.served_name}: 0 of {d.replicas} replicas ready{detail}"


def endpoint_table(replicas: Mapping[str, Replica], nodes: Mapping[str, NodeSide]
                   ) -> dict[str, list[dict[str, Any]]]:
    """Served name -> replicas. A suspect node's replicas stay: the router judges by
    whether the engine answers. A lost node's do not."""
    return _strip(_rows(replicas, nodes))


def without_keys(table: Mapping[str, Any]) -> dict[str, Any]:
    """The table with no engine keys in it: for a reader that is not a router (an admin's
    ctl), which has no business sending requests to engines. The agents' public keys in
    `kv` stay: they are not secret, and a key alone lets no one in."""
    models = {name: [{k: v for k, v in e.items() if k != "key"} for e in entries]
              for name, entries in table.get("models", {}).items()}
    return {**table, "models": models}


def _strip(rows: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    return {name: [{k: v for k, v in e.items() if k != "served"} for e in entries]
            for name, entries in rows.items()}


def _rows(replicas: Mapping[str, Replica], nodes: Mapping[str, NodeSide]
          ) -> dict[str, list[dict[str, Any]]]:
    table: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(replicas.values(), key=lambda r: r.id):
        if not r.endpoint or r.state not in ROUTABLE:
            continue
        head = nodes.get(r.members[0].node_id)
        if head is None or head.state == NodeState.LOST and r.state != ReplicaState.HELD:
            continue
        row: dict[str, Any] = {"replica_id": r.id, "url": r.endpoint,
                               "ready": sleeping.serving(r),
                               "served": r.spec.served_name}
        # The adapters its head engine reports loaded; the key only where there are
        # some, so a router from before adapters reads the table as before.
        loaded = adapters.replica_adapters(r, head.engines.get(r.id))
        if loaded:
            row["adapters"] = list(loaded)
        # Its engine's own key (engine keys), for the router's Authorization header; only where
        # the agent reported one. ops.py gives it to routers only.
        rep = head.engines.get(r.id)
        if rep is not None and rep.api_key:
            row["key"] = rep.api_key
        # Its engine schedules by the request's `priority` (the router writes it from the
        # request's class); only where true, so a router from before reads the rest.
        if takes_priority(r.spec):
            row["priority"] = True
        # Where a router follows its engine's KV-cache events (kv_aware routing): its head
        # node's agent relay, which is a CURVE server with the node's own key. Only where
        # the deployment has kv_events and the agent advertised a relay (a router from
        # before reads every other row as before).
        if r.spec.kv_events and head.info.kv_relay and head.key:
            row["kv"] = {"endpoint": head.info.kv_relay, "key": head.key}
        table.setdefault(r.spec.served_name, []).append(row)
    return table
