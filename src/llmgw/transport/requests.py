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

from llmgw.config.addresses import AddressError, parse_host_port, parse_tcp
from llmgw.model.deployment import Deployment
from llmgw.model.engine import check_engine_key
from llmgw.transport.apikey_ops import (
    ApiKeyCreateOp,
    ApiKeyImportOp,
    ApiKeyListOp,
    ApiKeyRevokeOp,
    ApiKeyUpdateOp,
    KeyTableOp,
    LeaseOp,
    UsageOp,
    UsageReportOp,
)
from llmgw.transport.gpu_ops import GpuClearOp

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
    # On a deployment with autoscale: set the count anyway and switch autoscale off for it
    # until its next apply. Without it, such a deployment is refused (its count is automatic).
    pin: bool = False


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


# The most served names one load report may carry (a router serves the table's models).
MAX_REPORTED_MODELS = 4096
MAX_LOAD = 1e9


def _load_figure(_: object, a: object, value: float) -> None:
    if not 0 <= value <= MAX_LOAD:  # NaN fails too
        raise ValueError(f"{getattr(a, 'name', 'figure')}: expected 0 to {MAX_LOAD:g}, got {value!r}")


def _bounded_models(_: object, __: object, value: dict[str, ModelLoad]) -> None:
    if len(value) > MAX_REPORTED_MODELS:
        raise ValueError(f"a load report names at most {MAX_REPORTED_MODELS} models, got {len(value)}")


@frozen
class ModelLoad:
    """One router's load of one served name over its last report interval."""

    in_flight: float = field(default=0.0, validator=_load_figure)  # sent, not answered; held too
    waiting: float = field(default=0.0, validator=_load_figure)  # the engines' own queues
    requests: int = field(default=0, validator=_load_figure)  # arrived in the interval
    held: int = field(default=0, validator=_load_figure)  # waiting for a replica (scale from zero)


@frozen
class LoadReportOp:
    """A router's load per served name (elastic deployments): every `load_report_interval`, and at
    once when it starts holding requests for a model with nothing ready (a wake)."""

    models: dict[str, ModelLoad] = field(factory=dict, validator=_bounded_models)
    interval: float = field(default=5.0, validator=_load_figure)  # seconds between reports
    wake: bool = False


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
    | LoadReportOp
    # API keys and limits: transport/apikey_ops.py
    | ApiKeyCreateOp
    | ApiKeyUpdateOp
    | ApiKeyRevokeOp
    | ApiKeyListOp
    | ApiKeyImportOp
    | KeyTableOp
    | UsageReportOp
    | UsageOp
    | LeaseOp
    # ctl gpu clear (GPU health): transport/gpu_ops.py
    | GpuClearOp
)


# ---- results ----


def _engine_url(_: object, __: object, value: str) -> None:
    try:
        if not value.startswith("http://"):
            raise AddressError("no http://")
        parse_host_port(value[len("http://"):].removesuffix("/"))
    except AddressError:
        raise ValueError(f"not an engine URL (http://host:port): {value[:100]!r}") from None


def _relay_address(_: object, __: object, value: str) -> None:
    try:
        parse_tcp(value)
    except AddressError:
        raise ValueError(f"not a relay address (tcp://host:port): {value[:100]!r}") from None


def _z85_public_key(_: object, __: object, value: str) -> None:
    if len(value) != 40 or not value.isascii() or not value.isprintable() or " " in value:
        raise ValueError(f"not a CURVE public key (40 characters of z85): {value[:100]!r}")


@frozen
class KvRelay:
    """Where a router follows a replica's KV-cache events (kv_aware routing): its head
    node's agent relay, a CURVE server whose public key is the node's own."""

    endpoint: str = field(validator=_relay_address)  # tcp://mgmt_addr:kv_relay_port
    key: str = field(validator=_z85_public_key)  # z85


@frozen
class Endpoint:
    replica_id: str
    url: str = field(validator=_engine_url)
    ready: bool = True
    # LoRA adapters its engine has loaded: the router sends an adapter's requests only
    # here. Sent only when there are some, so a router from before adapters reads the rest.
    adapters: tuple[str, ...] = ()
    # The engine's own API key, which the router sends it as `Authorization: Bearer`
    # (engine keys). Sent only where there is one, and only to routers.
    key: str = field(default="", validator=lambda _, __, v: check_engine_key(v), repr=False)
    # Its engine schedules by the request's `priority` (vLLM --scheduling-policy
    # priority): the router writes the field from the request's class. Sent only when true.
    priority: bool = False
    # Its engine publishes KV-cache events (kv_events) and its head node's agent relays
    # them here. Sent only then: a router from before reads every other row as before
    # (a row with it is an extra key to such a router: upgrade routers first).
    kv: KvRelay | None = None


@frozen
class EndpointsResult:
    """The answer to EndpointsOp: what the router routes by."""

    version: int
    models: dict[str, tuple[Endpoint, ...]] = field(factory=dict)  # served name -> replicas
    # Served name -> why none of it is ready (deployed, serving nothing): a 503, not a 404.
    waiting: dict[str, str] = field(factory=dict)
    # Served names with autoscale down to zero (or waking from it): routable though no
    # replica is ready. The router holds their requests and wakes them. Sent only when
    # non-empty, so a router from before autoscale reads the rest.
    cold: tuple[str, ...] = ()


def op_name(cls: type) -> str:
    """`RediscoverOp` -> "rediscover"."""
    return cls.__name__.removesuffix("Op").lower()
