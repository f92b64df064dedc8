"""What ctl and the router may ask the server: one attrs class per op.

A Request carries exactly one of these in its `op` field, tagged by the op's name
(`StatusOp` is "status"). Each is validated when the Request is decoded, once: the
handlers on the server get typed values and check only what depends on the server's
state (does that deployment exist). A deployment travels as a Deployment and is
structured on arrival by the same validator as a deployment file (config/deployment.py).
"""

from __future__ import annotations

import enum

from attrs import frozen

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


@frozen
class DescribeOp:
    name: str


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


def op_name(cls: type) -> str:
    """`RediscoverOp` -> "rediscover"."""
    return cls.__name__.removesuffix("Op").lower()
