"""What `ctl status` shows, as plain data (the same object `-o json` prints)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.model.engine import EngineReport
from llmgw.model.inventory import Gpu, Inventory, StorageReport
from llmgw.model.node import NodeState
from llmgw.server.cluster import Cluster
from llmgw.server.peers.sessions import ControlPlane, Node
from llmgw.server.placement.fabrics import fabric_view, islands, member_nics
from llmgw.server.reconcile.adapters import lora_sharing
from llmgw.server.reconcile.replica_states import BACKING_OFF
from llmgw.server.store.sql import StoredEvent


def _storage(s: StorageReport) -> dict[str, Any]:
    # Where an engine with no copy downloads, and the space there (weights the node holds): -1 unknown.
    where = {"download_dir": s.download_dir, "download_free": s.download_free} if s.download_dir else {}
    if not s.asked:
        return {"asked": False, **where}
    return {
        "asked": True,
        **where,
        "models": [
            {"name": m.name, "path": m.path, "complete": m.complete, "shared": m.shared,
             "store": m.store, "size": m.size, "reason": m.reason}
            for m in s.models
        ],
    }


GPU_STATES = ("healthy", "unhealthy", "degraded", "releasing", "held")


def gpu_state(g: Gpu) -> str:
    """One word per GPU, the first that holds: "unhealthy" (a hard problem: never placed,
    its replicas move), "degraded" (only soft problems: no new replica, what runs stays),
    "releasing" (an engine's memory not back yet: never placed), "held" (other processes on
    it: placed only where enough memory is free), "healthy"."""
    if g.hard_problems:
        return "unhealthy"
    if g.problems:
        return "degraded"
    if g.releasing:
        return "releasing"
    if g.processes:
        return "held"
    return "healthy"


def _gpus(inv: Inventory) -> list[dict[str, Any]]:
    return [
        {"uuid": g.uuid, "index": g.index, "name": g.name, "memory_total": g.memory_total,
         "memory_free": g.memory_free, "pci_bus_id": g.pci_bus_id, "numa_node": g.numa_node,
         "nvlink_peers": dict(g.nvlink_peers), "state": gpu_state(g),
         "problems": list(g.hard_problems), "soft_problems": list(g.soft_problems),
         "releasing": g.releasing,
         "processes": [{"pid": p.pid, "command": p.command, "memory": p.memory}
                       for p in g.processes]}
        for g in inv.gpus
    ]


def node_view(node: Node, now: float) -> dict[str, Any]:
    inv = node.inventory
    return {
        "id": node.node_id,
        "state": str(node.state),
        "cordoned": node.cordoned,
        "draining": node.draining,
        "heartbeat_age": round(max(0.0, now - node.last_seen), 1),
        "connected": node.connected,
        "mgmt_addr": node.info.mgmt_addr,
        # Where routers follow its engines' KV-cache events ("": its agent has no relay).
        "kv_relay": node.info.kv_relay,
        "labels": dict(node.info.labels),
        "fabrics": [{"name": f.name, "state": str(f.state), "hcas": list(f.hcas)}
                    for f in inv.fabrics],
        # Each HCA's ports and what the HCA watch says (collective pre-flight): one with problems does
        # not count in its fabric, and the replicas riding it are moved.
        "hcas": [{"name": h.name, "healthy": h.healthy, "problems": list(h.problems),
                  "ports": [{"number": p.number, "state": p.state, "rate_gbps": p.rate_gbps}
                            for p in h.ports]}
                 for h in inv.hcas],
        "gpus": _gpus(inv),
        "gpu_source": str(inv.gpu_source),
        "storage": _storage(inv.storage),
        "warnings": list(inv.warnings),
    }


def node_rows(cp: ControlPlane, now: float) -> list[dict[str, Any]]:
    return [node_view(n, now) for n in sorted(cp.nodes.values(), key=lambda n: n.node_id)]


def status_view(cp: ControlPlane, now: float) -> dict[str, Any]:
    nodes = sorted(cp.nodes.values(), key=lambda n: n.node_id)
    # Lost nodes' weights cannot serve anything; suspect ones still may.
    inventories = {n.node_id: n.inventory for n in nodes if n.state != NodeState.LOST}
    return {
        "nodes": [node_view(n, now) for n in nodes],
        "fabrics": fabric_view(inventories),
        "islands": islands(inventories),
    }


def replica_row(r: Replica, now: float | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": r.id,
        "deployment": r.deployment,
        "state": str(r.state),
        "generation": r.generation,
        "nodes": list(r.node_ids),
        "gpus": list(r.gpus),
        "endpoint": r.endpoint,
        "fabric": r.fabric,
        "restarts": r.restarts,
        "reason": r.reason,
    }
    if r.state in BACKING_OFF:
        row["backoff_until"] = r.backoff_until
        row["last_log_tail"] = list(r.last_log_tail)
    elif r.state == ReplicaState.DRAINING:
        # Out of the routers' tables since drain_since; stopped by drain_until at the latest.
        row["drain_since"] = r.drain_since
        row["drain_until"] = r.drain_until
    if r.spec.asleep:  # sleep_when_idle (server/reconcile/sleeping.py): placed, its engines asleep
        row["asleep"] = True
        row["reason"] = r.reason or "asleep: the next request wakes it"
    return row


def replica_rows(o: Cluster, last_events: Mapping[str, StoredEvent] | None = None
                 ) -> list[dict[str, Any]]:
    rows = []
    for r in sorted(o.replicas.values(), key=lambda r: r.id):
        row = replica_row(r)
        if r.state == ReplicaState.STARTING:
            # A member downloading its weights (weights the node holds): node -> bytes on disk and rate.
            downloads = member_downloads(o, r)
            if downloads:
                row["download"] = downloads
        if last_events is not None:
            e = last_events.get(r.id)
            row["last_event"] = {"ts": e.ts, "text": e.text} if e is not None else None
        rows.append(row)
    return rows


def _deployment_status(o: Cluster, d: Deployment, mine: list[Replica]) -> str:
    ready = sum(r.state == ReplicaState.READY for r in mine)
    # A pending replacement is a drain's: its target still serves, on the draining node.
    reasons = sorted({o.pending[r.id] for r in mine if r.id in o.pending and not r.replaces})
    if reasons:
        return "unschedulable: " + "; ".join(reasons)
    stuck = sorted(f"{r.replaces} is draining, with nowhere to move: {o.pending[r.id]}"
                   for r in mine if r.id in o.pending and r.replaces)
    if stuck:
        return "; ".join(stuck)
    if any(r.state == ReplicaState.CRASH_LOOPING for r in mine):
        return "crash-looping"
    if o.holding and any(r.state == ReplicaState.HELD for r in mine):
        return o.holding
    if d.asleep:
        return "asleep (the next request wakes it)"
    return "ready" if ready >= d.replicas else "progressing"


def deployment_rows(o: Cluster) -> list[dict[str, Any]]:
    rows = []
    for name, d in sorted(o.deployments.items()):
        mine = [r for r in o.replicas.values() if r.deployment == name]
        rows.append({
            "name": name,
            "model": d.model,
            "served_name": d.served_name,
            "engine": str(d.engine),
            "replicas": d.replicas,
            "ready": sum(r.state == ReplicaState.READY for r in mine),
            "status": _deployment_status(o, d, mine),
        })
    return rows


def describe_deployment(o: Cluster, d: Deployment, events: list[StoredEvent]) -> dict[str, Any]:
    mine = sorted((r for r in o.replicas.values() if r.deployment == d.name), key=lambda r: r.id)
    row = next(r for r in deployment_rows(o) if r["name"] == d.name)
    return {
        **row,
        "spec": d.plain(),
        "replica_list": [replica_row(r) for r in mine],
        "pending": {r.id: o.pending[r.id] for r in mine if r.id in o.pending},
        "events": [{"ts": e.ts, "replica": e.replica, "text": e.text} for e in events],
        # More adapters than LoRA slots: how they share them (LoRA adapters).
        **({"lora": sharing} if (sharing := lora_sharing(d)) else {}),
        **({"kv_relays": kv_relays(o, mine)} if d.kv_events else {}),
    }


def kv_relays(o: Cluster, replicas: Iterable[Replica]) -> dict[str, str]:
    """Replica -> where routers follow its engine's KV-cache events: its head node's
    agent relay, as the endpoint table names it ("": that agent advertises none). Placed
    replicas only."""
    out = {}
    for r in replicas:
        if r.members:
            head = o.cp.nodes.get(r.members[0].node_id)
            out[r.id] = head.info.kv_relay if head is not None else ""
    return out


def describe_node(o: Cluster, node: Node, now: float) -> dict[str, Any]:
    """A node as `ctl status` shows it, with the replicas that have a member on it."""
    mine = sorted((r for r in o.replicas.values() if node.node_id in r.node_ids),
                  key=lambda r: r.id)
    # The last passed pre-flight of each of the node's fabrics (collective pre-flight).
    mine_fabrics = {f.name for f in node.inventory.fabrics}
    figures = {f: v for f, v in preflight_by_fabric(o).items() if f in mine_fabrics}
    # And the last passed one of a single-node replica on its GPUs (NVLink or PCIe).
    local = local_preflight((r, _member_reports(o, r)) for r in mine)
    return {**node_view(node, now), "replica_list": [_with_last_event(o, r) for r in mine],
            "preflight": figures, **({"preflight_gpus": local} if local else {})}


def describe_replica(o: Cluster, r: Replica, events: list[StoredEvent]) -> dict[str, Any]:
    """A replica's row, why it waits if it does, its last failure's log and its events."""
    return {
        **replica_row(r),
        "spec": r.spec.plain(),
        "replaces": r.replaces,
        "pending": o.pending.get(r.id, ""),
        "last_log_tail": list(r.last_log_tail),
        "events": [{"ts": e.ts, "replica": e.replica, "text": e.text} for e in events],
        # Which HCA each gang member's GPUs ride (collective pre-flight).
        "nics": member_nics(r.members, {n: v.inventory for n, v in o.cp.nodes.items()}),
        **_engine_facts(o, r),
    }


def member_downloads(o: Cluster, r: Replica) -> dict[str, str]:
    """Node -> how far its member's engine has downloaded its weights, for this
    generation ("12.3 GB on disk, 210 MB/s"; EngineReport.download); members that download
    nothing left out."""
    out = {}
    for m in r.members:
        node = o.cp.nodes.get(m.node_id)
        rep = node.engines.get(r.id) if node is not None else None
        if rep is not None and rep.generation == r.generation and rep.download:
            out[m.node_id] = rep.download
    return out


def _engine_facts(o: Cluster, r: Replica) -> dict[str, Any]:
    """What each member's engine reported of this generation (weights the node holds): the weights it
    loads, node -> line; and, where the spec has adapters, node -> {loaded, errors}."""
    weights: dict[str, str] = {}
    adapters: dict[str, dict[str, list[str]]] = {}
    reports = _member_reports(o, r)
    for m in r.members:
        rep = reports.get(m.node_id)
        if rep is None:
            continue
        if rep.weights:
            weights[m.node_id] = rep.weights
        if r.spec.adapters and m.rank == 0:  # the head serves the API, and the adapters
            adapters[m.node_id] = {"loaded": list(rep.adapters), "errors": list(rep.adapter_errors)}
    return {"weights": weights, "download": member_downloads(o, r),
            **({"adapters": adapters} if r.spec.adapters else {}),
            # Each member's pre-flight (collective pre-flight), node -> line: running, passed with its
            # figures, failed with why.
            "preflight": member_preflight(r, reports)}


def _member_reports(o: Cluster, r: Replica) -> dict[str, EngineReport]:
    """Node -> its engine's report of this replica's generation (members heard only)."""
    out = {}
    for m in r.members:
        node = o.cp.nodes.get(m.node_id)
        rep = node.engines.get(r.id) if node is not None else None
        if rep is not None and rep.generation == r.generation:
            out[m.node_id] = rep
    return out


def member_preflight(r: Replica, reports: Mapping[str, EngineReport]) -> dict[str, str]:
    """Node -> the pre-flight line its member's engine reported ("" ones left out)."""
    return {m.node_id: reports[m.node_id].preflight for m in r.members
            if m.node_id in reports and reports[m.node_id].preflight}


def fabric_preflight(replicas: Iterable[tuple[Replica, Mapping[str, EngineReport]]]
                     ) -> dict[str, dict[str, Any]]:
    """The last figures per fabric: of the replicas on a fabric whose every member passed
    its pre-flight, the one placed last: fabric -> {"replica", "busbw_gbps" (the lowest
    member's, GB/s at the probe's largest size), "members": node -> line}. Only replicas
    that still run are known (the agents' reports): a fabric none rides has no figures."""
    out: dict[str, dict[str, Any]] = {}
    when: dict[str, float] = {}
    for r, reports in replicas:
        if not r.fabric or len(r.members) < 2:
            continue
        lines = member_preflight(r, reports)
        if len(lines) != len(r.members) or not all(x.startswith("passed") for x in lines.values()):
            continue
        if r.fabric in when and when[r.fabric] >= r.placed_at:
            continue
        when[r.fabric] = r.placed_at
        out[r.fabric] = {"replica": r.id,
                         "busbw_gbps": min(reports[n].preflight_busbw_gbps for n in lines),
                         "members": lines}
    return dict(sorted(out.items()))


def local_preflight(replicas: Iterable[tuple[Replica, Mapping[str, EngineReport]]]
                    ) -> dict[str, Any]:
    """Of the single-node replicas whose probe passed (a tensor-parallel one that asks,
    the collective pre-flight), the one placed last: {"replica", "busbw_gbps" (GB/s at the probe's largest
    size), "line"}; {} when none. The figure of a node's own GPU links, not a fabric's."""
    best: dict[str, Any] = {}
    when = -1.0
    for r, reports in replicas:
        if len(r.members) != 1 or r.placed_at <= when:
            continue
        rep = reports.get(r.members[0].node_id)
        if rep is None or not rep.preflight.startswith("passed"):
            continue
        when = r.placed_at
        best = {"replica": r.id, "busbw_gbps": rep.preflight_busbw_gbps, "line": rep.preflight}
    return best


def preflight_by_fabric(o: Cluster) -> dict[str, dict[str, Any]]:
    """fabric_preflight over the orchestrator's replicas and the agents' reports."""
    return fabric_preflight((r, _member_reports(o, r)) for r in o.replicas.values() if r.fabric)


def _with_last_event(o: Cluster, r: Replica) -> dict[str, Any]:
    e = o.last_events.get(r.id)
    return {**replica_row(r), "last_event": {"ts": e.ts, "text": e.text} if e is not None else None}


def status_document(o: Cluster, now: float) -> dict[str, Any]:
    """What `ctl status -o json` prints, and the status page's /status.json."""
    notes = [o.holding] if o.holding else []
    if o.rebuilt:
        notes.append("rebuilt from the cluster (the state folder had no record of them): "
                     + ", ".join(sorted(o.rebuilt)))
    notes += o.rebuild_notes
    return {**status_view(o.cp, now),
            "deployments": deployment_rows(o), "replicas": replica_rows(o, o.last_events),
            "notes": notes, "preflight": preflight_by_fabric(o),  # per fabric (collective pre-flight)
            # Per API key x model since this server started (API keys and limits; `ctl usage`: stored).
            "usage": o.apikeys.usage_totals.rows()}
