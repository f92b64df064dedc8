"""What ctl (and the routers) may ask the server: one handler per op type, and
`ops()`, the table that says who may send each and which handler answers it (the control
plane dispatches through it, sessions.py; API keys and usage bring their own,
tenants/apikeys.py). The handlers read and change the cluster's state through the
interface they are given (cluster.py); the state and the pass loop stay in
orchestrator.py, the server's assembly (peers/service.py) builds the handlers, the endpoint
table is built in endpoints.py (pure) and the status document in status.py.

Handlers that write the store are async: they answer once it is written.
"""

from __future__ import annotations

import uuid
from typing import Any

import trio
from attrs import evolve

from llmgw.config.deployment import MAX_REPLICAS
from llmgw.config.vllm_serve import apply_refusal
from llmgw.logbound import clip
from llmgw.model.deployment import Deployment
from llmgw.model.node import NodeState
from llmgw.server import endpoints
from llmgw.server.cluster import Cluster
from llmgw.server.peers.sessions import OpHandler, Peer, RequestError
from llmgw.server.reconcile import adapters
from llmgw.server.status import (
    deployment_rows,
    describe_deployment,
    describe_node,
    describe_replica,
    node_rows,
    replica_rows,
    status_document,
)
from llmgw.server.store.sql import StoredEvent
from llmgw.transport.messages import LogsReply, LogsRequest, Rediscover
from llmgw.transport.requests import (
    MAX_LOG_LINES,
    ApplyOp,
    CordonOp,
    DeleteOp,
    DescribeOp,
    DescribeWhat,
    EndpointsOp,
    GetOp,
    GetWhat,
    LoadReportOp,
    LogsOp,
    RediscoverOp,
    ScaleOp,
    StatusOp,
)

ADMIN = frozenset({"admin"})
READERS = frozenset({"admin", "router"})
LOGS_TIMEOUT = 5.0  # seconds to wait for a node to send an engine's log tail


class Ops:
    def __init__(self, o: Cluster) -> None:
        self.o = o
        # The endpoint table last answered and its version: a router that asks again
        # sees the same version while nothing in it changed.
        self._endpoints: dict[str, Any] = {}
        self._endpoints_version = 0

    def ops(self) -> dict[type, tuple[frozenset[str], OpHandler]]:
        return {
            StatusOp: (ADMIN, self.op_status),
            ApplyOp: (ADMIN, self.op_apply),
            DeleteOp: (ADMIN, self.op_delete),
            ScaleOp: (ADMIN, self.op_scale),
            CordonOp: (ADMIN, self.op_cordon),
            GetOp: (ADMIN, self.op_get),
            DescribeOp: (ADMIN, self.op_describe),
            EndpointsOp: (READERS, self.op_endpoints),
            LogsOp: (ADMIN, self.op_logs),
            RediscoverOp: (ADMIN, self.op_rediscover),
            LoadReportOp: (frozenset({"router"}), self.op_load_report),
        }

    async def op_apply(self, peer: Peer, op: ApplyOp, now: float) -> Any:
        d = op.deployment  # validated when the request was decoded
        old = self.o.deployments.get(d.name)
        if d.autoscale is not None and old is not None:
            # With autoscale the file's replicas is only where a new deployment starts:
            # an apply keeps the count the autoscaler (or a pin) set, within min..max.
            a = d.autoscale
            d = evolve(d, replicas=min(max(old.replicas, a.min), a.max), asleep=old.asleep and d.sleep_mode)
        if old == d:
            return {"deployment": d.name, "changed": False}
        clash = adapters.name_conflict(d, self.o.deployments) or apply_refusal(d)
        if clash:
            raise RequestError(f"deployment {d.name!r}: {clash}")
        await trio.to_thread.run_sync(self.o.store.put_deployment, d, now)
        self.o.deployments[d.name] = d
        what = "created" if old is None else "updated"
        note = adapters.apply_note(old, d)
        what += f" ({note})" if note else ""
        await trio.to_thread.run_sync(self.o.store.add_events, [StoredEvent(now, d.name, "", what)])
        self.o.mark_deployment(d.name)
        return {"deployment": d.name, "changed": True, "action": what}

    def _deployment(self, name: str) -> Deployment:
        d = self.o.deployments.get(name)
        if d is None:
            raise RequestError(f"no deployment named {clip(name, 100)!r}")
        return d

    async def op_delete(self, peer: Peer, op: DeleteOp, now: float) -> Any:
        self._deployment(op.name)
        await trio.to_thread.run_sync(self.o.store.delete_deployment, op.name)
        del self.o.deployments[op.name]
        self.o.mark_deployment(op.name)
        return {"deployment": op.name, "deleted": True}

    async def op_scale(self, peer: Peer, op: ScaleOp, now: float) -> Any:
        if not 0 <= op.replicas <= MAX_REPLICAS:
            raise RequestError(f"replicas: expected 0 to {MAX_REPLICAS}, got {op.replicas}")
        d = self._deployment(op.name)
        note = ""
        if d.autoscale is not None:
            a = d.autoscale
            if not op.pin:
                raise RequestError(
                    f"deployment {op.name!r} scales automatically ({a.min}..{a.max}, now "
                    f"{d.replicas}); `ctl scale {op.name} --replicas {op.replicas} --pin` sets "
                    "the count and switches autoscale off until the next apply")
            # Pinned: autoscale off in the stored deployment; the next apply of its file
            # brings it back (from the pinned count).
            d = evolve(d, autoscale=None)
            note = "pinned: autoscale is off for it until the next apply"
            await trio.to_thread.run_sync(self.o.store.add_events, [StoredEvent(
                now, op.name, "", f"pinned at {op.replicas} by ctl scale --pin: autoscale off "
                                  "until the next apply")])
        await self.o.put_replicas(evolve(d, replicas=op.replicas), now)
        out: dict[str, Any] = {"deployment": op.name, "replicas": op.replicas}
        if note:
            out["note"] = note
        return out

    def op_load_report(self, peer: Peer, op: LoadReportOp, now: float) -> Any:
        self.o.autoscaler.report(peer.identity, now, op, self.o.deployments)
        return {}

    async def op_cordon(self, peer: Peer, op: CordonOp, now: float) -> Any:
        node_id = op.node
        if node_id not in self.o.cp.nodes:
            raise RequestError(f"no node named {clip(node_id, 100)!r}")
        await trio.to_thread.run_sync(
            lambda: self.o.store.set_cordoned(node_id, op.cordoned, draining=op.draining))
        self.o.cp.set_cordoned(node_id, op.cordoned, op.draining)
        self.o.mark_node(node_id)
        return {"node": node_id, "cordoned": op.cordoned, "draining": op.draining}

    def op_get(self, peer: Peer, op: GetOp, now: float) -> Any:
        if op.what is GetWhat.DEPLOYMENTS:
            return deployment_rows(self.o)
        if op.what is GetWhat.REPLICAS:
            return replica_rows(self.o)
        return node_rows(self.o.cp, now)

    async def op_describe(self, peer: Peer, op: DescribeOp, now: float) -> Any:
        if op.what is DescribeWhat.NODE:
            node = self.o.cp.nodes.get(op.name)
            if node is None:
                raise RequestError(f"no node named {clip(op.name, 100)!r}")
            return describe_node(self.o, node, now)
        if op.what is DescribeWhat.REPLICA:
            r = self.o.replicas.get(op.name)
            if r is None:
                raise RequestError(f"no replica named {clip(op.name, 100)!r}")
            events = await trio.to_thread.run_sync(
                lambda: self.o.store.events(replica=op.name, limit=50))
            return describe_replica(self.o, r, events)
        d = self._deployment(op.name)
        events = await trio.to_thread.run_sync(
            lambda: self.o.store.events(deployment=op.name, limit=50))
        return describe_deployment(self.o, d, events)

    def op_rediscover(self, peer: Peer, op: RediscoverOp, now: float) -> Any:
        """Ask nodes to run discovery now; they report what changed as usual."""
        wanted = list(op.nodes) or sorted(self.o.cp.nodes)
        unknown = [n for n in wanted if n not in self.o.cp.nodes]
        if unknown:
            raise RequestError(f"no node named {clip(unknown[0], 100)!r}")
        asked = [n for n in wanted if self.o.cp.nodes[n].connected and self.o.cp.nodes[n].routing_id]
        self.o.send([(self.o.cp.nodes[n].routing_id, Rediscover()) for n in asked])
        return {"asked": asked, "not_connected": sorted(set(wanted) - set(asked))}

    async def op_logs(self, peer: Peer, op: LogsOp, now: float) -> Any:
        rid = op.replica
        if not 1 <= op.lines <= MAX_LOG_LINES:
            raise RequestError(f"lines: expected 1 to {MAX_LOG_LINES}, got {op.lines}")
        lines = op.lines
        r = self.o.replicas.get(rid)
        if r is None:
            raise RequestError(f"no replica named {clip(rid, 100)!r}")
        if not r.members:
            return {"replica": rid, "node": "", "lines": list(r.last_log_tail),
                    "note": "not placed now; this is the log tail of its last failure"}
        node_id = r.members[0].node_id
        node = self.o.cp.nodes.get(node_id)
        if node is None or not node.connected or node.state == NodeState.LOST:
            raise RequestError(f"node {node_id} is not connected; cannot fetch the log of {rid}")
        request_id = uuid.uuid4().hex
        got: list[LogsReply] = []
        arrived = trio.Event()

        def deliver(reply: LogsReply) -> None:
            got.append(reply)
            arrived.set()

        self.o.cp.pending_logs[request_id] = deliver
        self.o.send([(node.routing_id, LogsRequest(request_id, rid, lines))])
        with trio.move_on_after(LOGS_TIMEOUT):
            await arrived.wait()
        self.o.cp.pending_logs.pop(request_id, None)
        if not got:
            raise RequestError(f"node {node_id} did not answer within {LOGS_TIMEOUT:g}s")
        if got[0].error:
            raise RequestError(f"node {node_id}: {got[0].error}")
        return {"replica": rid, "node": node_id, "lines": list(got[0].lines)}

    def op_endpoints(self, peer: Peer, op: EndpointsOp, now: float) -> Any:
        o = self.o
        table = endpoints.table(o.deployments, o.replicas, o.pending, o.cp.nodes)
        if table != self._endpoints:
            self._endpoints = table
            self._endpoints_version += 1
        if peer.role != "router":
            table = endpoints.without_keys(table)
        return {"version": self._endpoints_version, **table}

    def op_status(self, peer: Peer, op: StatusOp, now: float) -> Any:
        return status_document(self.o, now)
