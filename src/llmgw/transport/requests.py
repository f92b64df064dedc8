"""What ctl and the router may ask the server: one attrs class per op.

A Request carries exactly one of these in its `op` field, tagged by the op's name
(`StatusOp` is "status"). Each is validated when the Request is decoded, once: the
handlers on the server get typed values and check only what depends on the server's
state (does that deployment exist). A deployment travels as a Deployment and is
structured on arrival by the same validator as a deployment file (config/deployment.py).
"""

from __future__ import annotations

import enum

from attrs import field, frozen

from llmgw.config.addresses import AddressError, parse_host_port
from llmgw.model.deployment import Deployment

# The most log lines one `logs` request may ask for.
MAX_LOG_LINES = 4096


@frozen
class StatusOp:
    """Nodes, fabrics, deployments, replicas."""


@frozen
class ApplyOp:
    deployment: Deployment
    source: str = ""  # the file it came from, for events and errors


@frozen
class DeleteOp:
    name: str


@frozen
class ScaleOp:
    name: str
    replicas: int


@frozen
class CordonOp:
    node: str
    cordoned: bool = True
    draining: bool = False


class GetWhat(enum.StrEnum):
    DEPLOYMENTS = "deployments"
    REPLICAS = "replicas"
    NODES = "nodes"


@frozen
class GetOp:
    what: GetWhat


class DescribeWhat(enum.StrEnum):
    DEPLOYMENT = "deployment"
    NODE = "node"
    REPLICA = "replica"


@frozen
class DescribeOp:
    name: str
    # Defaulted: a ctl from before `describe node|replica` still asks for a deployment.
    what: DescribeWhat = DescribeWhat.DEPLOYMENT


@frozen
class EndpointsOp:
    since: int = -1  # the table version the router has


@frozen
class LogsOp:
    replica: str
    lines: int = 200


@frozen
class RediscoverOp:
    nodes: tuple[str, ...] = ()  # none: every node


Op = (
    StatusOp
    | ApplyOp
    | DeleteOp
    | ScaleOp
    | CordonOp
    | GetOp
    | DescribeOp
    | EndpointsOp
    | LogsOp
    | RediscoverOp
)


# ---- results ----


def _engine_url(_: object, __: object, value: str) -> None:
    try:
        if not value.startswith("http://"):
            raise AddressError("no http://")
        parse_host_port(value[len("http://"):].removesuffix("/"))
    except AddressError:
        raise ValueError(f"not an engine URL (http://host:port): {value[:100]!r}") from None


@frozen
class Endpoint:
    replica_id: str
    url: str = field(validator=_engine_url)
    ready: bool = True
    # LoRA adapters its engine has loaded: the router sends an adapter's requests only
    # here. Sent only when there are some, so a router from before adapters reads the rest.
    adapters: tuple[str, ...] = ()


@frozen
class EndpointsResult:
    """The answer to EndpointsOp: what the router routes by."""

    version: int
    models: dict[str, tuple[Endpoint, ...]] = field(factory=dict)  # served name -> replicas
    # Served name -> why none of it is ready (deployed, serving nothing): a 503, not a 404.
    waiting: dict[str, str] = field(factory=dict)


def op_name(cls: type) -> str:
    """`RediscoverOp` -> "rediscover"."""
    return cls.__name__.removesuffix("Op").lower()
