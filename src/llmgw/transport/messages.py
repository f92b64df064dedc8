"""Every message on the wire, one attrs class per kind.

The codec (codec.py) encodes them as a msgpack map with a `kind` tag. Agents speak
Hello/Heartbeat/InventoryChanged/EngineChanged/LogsReply; the server answers with
Welcome/Refused/HelloFirst/HeartbeatAck/DesiredSet/Rediscover/LogsRequest/ClearGpu/
RouterKeys. ctl and the router send Request, carrying one typed op of requests.py, and
get Reply (the router polls the "endpoints" op).
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from llmgw.model.engine import EngineReport, EngineSpec
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.transport.requests import Op

# ---- agent -> server ----


@frozen
class Hello:
    protocol: int
    node: NodeInfo
    inventory: Inventory
    engines: tuple[EngineReport, ...] = ()


@frozen
class Heartbeat:
    seq: int


@frozen
class InventoryChanged:
    inventory: Inventory


@frozen
class EngineChanged:
    report: EngineReport


@frozen
class LogsReply:
    request_id: str
    replica_id: str
    lines: tuple[str, ...] = ()
    error: str = ""


# ---- server -> agent ----


@frozen
class Welcome:
    protocol: int
    node_id: str
    heartbeat_interval: float  # seconds the server expects between heartbeats


@frozen
class Refused:
    reason: str


@frozen
class HelloFirst:
    """The server has no session for this peer (it restarted, or never saw a Hello)."""

    reason: str = ""


@frozen
class HeartbeatAck:
    seq: int


@frozen
class DesiredSet:
    """The node's whole desired engine set. Level-triggered: a repeat does no harm."""

    generation: int
    engines: tuple[EngineSpec, ...] = ()


@frozen
class Rediscover:
    """Run discovery now (ctl asked) and report what changed."""


@frozen
class ClearGpu:
    """Forget these GPUs' Xid problems (by UUID): the operator's `ctl gpu clear`. An agent
    from before this message logs it as a bad message and goes on."""

    gpus: tuple[str, ...] = ()


@frozen
class RouterKeys:
    """The public keys (z85) of every router key the server authorizes now: the routers
    this agent's KV-event relay may let in. The whole set each time (level-triggered), on
    Hello and whenever it changes; sent only to agents that advertised a relay in Hello
    (NodeInfo.kv_relay), which know this message: an agent from before never gets one.
    Like every list on the wire, at most codec.MAX_ITEMS (4,096) router keys."""

    keys: tuple[str, ...] = ()


@frozen
class LogsRequest:
    request_id: str
    replica_id: str
    lines: int = 200


@frozen
class NotLeader:
    """A standby server's answer to any message (several servers on PostgreSQL): it does
    not lead. `leader` is the leader's address as the servers advertise it ("" while none
    is known); `request_id` echoes a request's."""

    leader: str = ""
    request_id: str = ""


# ---- ctl / router -> server, and back ----


@frozen
class Request:
    protocol: int
    request_id: str
    op: Op  # one typed op (requests.py), tagged by its name: {"op": "status", ...}


@frozen
class Reply:
    request_id: str
    ok: bool
    result: Any = None
    error: str = ""


Message = (
    Hello
    | Heartbeat
    | InventoryChanged
    | EngineChanged
    | LogsReply
    | Welcome
    | Refused
    | HelloFirst
    | HeartbeatAck
    | DesiredSet
    | Rediscover
    | ClearGpu
    | RouterKeys
    | LogsRequest
    | NotLeader
    | Request
    | Reply
)
