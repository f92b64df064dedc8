"""Deployments (what the operator asked for) and replicas (where the server put them).

A Deployment is the desired state as loaded from a YAML file. A Replica is one copy of
it, placed onto one node (or, for `nodes > 1`, a gang of members in one fabric). Each
replica keeps the spec it was created from, so a replica of an older spec keeps running
that spec while a rolling update replaces it.

Replica ids are `f"{deployment}-{index}"` and stable for the replica's life. The
generation is bumped whenever the replica is started afresh (a restart after a crash, a
re-placement after node loss); agents run engines keyed by (replica id, generation),
so an engine of an older generation is fenced off by the node's desired set.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any

from attrs import Factory, field, frozen

from .autoscale import Autoscale
from .engine import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    RUNTIME_ADAPTERS,
    Adapter,
    EngineKind,
    EngineSpec,
    GangSpec,
)

# Ports reserved on each member of a Ray gang for that replica's Ray processes: a few
# fixed ones (node manager, object manager, agents), then the workers' range.
RAY_PORT_BLOCK = 64
# Ports reserved on each vLLM or SGLang member for the engine's own internal ports, so that
# engines starting together on one node do not race for the same free port (vllm#43206,
# #39015). vLLM (0.32, utils/network_utils.py) takes VLLM_PORT as the first port and walks
# up from it to the next free one on every get_open_port(): one for torch.distributed's
# store, five for data parallel's master ports, world size + 1 for fault tolerance, at
# most 15 for tensor parallel 8. SGLang takes the layout below. The simulated engine binds
# only its HTTP port (and a gang's rendezvous): it gets no block.
ENGINE_PORT_BLOCK = 16
# SGLang's ports in the engine block (sglang 0.5.23, srt/server_args.py PortArgs.init_new):
# --nccl-port first, then the dist-init port, of which SGLang with dp attention binds the
# six after it too (tokenizer, detokenizer, rpc, metrics, scheduler input, load collector).
SGLANG_NCCL_PORT = 0
SGLANG_DIST_INIT = 1
SGLANG_DIST_INIT_NEIGHBOURS = 6
# KV-cache events (Deployment.kv_events) in the engine block, at its top: the engine's PUB
# connects to KV_EVENTS_PUB on loopback, which the agent binds, and the engine binds its
# replay ROUTER on KV_EVENTS_REPLAY, loopback only. vLLM's VLLM_PORT walk starts at the
# bottom of the block and, without data parallelism (refused with kv_events), takes one
# port there for torch.distributed's store (v1/executor/multiproc_executor.py,
# get_open_port once); it reaches the top only with DP's five master ports and its fault
# tolerance's world size + 1. SGLang uses the bottom eight at most (above). The last port
# of the block stays the single-node pre-flight probe's (agent/engines/preflight.py
# local_port), which runs before the engine, while the agent may already hold KV_EVENTS_PUB.
KV_EVENTS_PUB = ENGINE_PORT_BLOCK - 3
KV_EVENTS_REPLAY = ENGINE_PORT_BLOCK - 2


class Strategy(enum.StrEnum):
    SPREAD = "spread"  # most free GPUs left: spread load
    PACK = "pack"  # fewest free GPUs left: keep whole nodes free for large replicas


@frozen
class Deployment:
    name: str
    model: str  # "org/name" id or absolute path
    engine: EngineKind
    gpus_per_node: int  # tensor-parallel size
    replicas: int
    nodes: int = 1  # members per replica; above 1 the replica spans one fabric
    served_name: str = field(default=Factory(lambda self: self.model, takes_self=True))
    gpu_memory_min: int = 0  # MiB per GPU; 0: any
    selector: dict[str, str] = field(factory=dict)
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(factory=dict)
    startup_timeout: float = 600.0  # seconds
    strategy: Strategy = Strategy.SPREAD
    # Seconds a replica leaving for a reason other than a failure (scale-down, delete,
    # drain, rollout) may go on serving the requests it has once no router sends it new
    # ones; it stops sooner when its engine is idle. Per deployment, like Kubernetes'
    # terminationGracePeriodSeconds: how long a request may run is the model's trait
    # (a reasoning model's minutes-long answers, an embedder's milliseconds). It shapes
    # no engine, so it is left out of template_hash: changing it rolls nothing.
    drain_timeout: float = 60.0
    # LoRA adapters served on this deployment's engines, by name (a path the nodes see).
    # LoRA is enabled at start when there are adapters or max_loras is set (0: not set,
    # DEFAULT_MAX_LORAS when enabled): set it to add and remove adapters freely, down to
    # none, without a restart of a vLLM engine.
    adapters: tuple[Adapter, ...] = ()
    max_loras: int = 0
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    # Replicas that follow load (model/autoscale.py); None: `replicas` is fixed. It shapes
    # no engine, so it is left out of template_hash.
    autoscale: Autoscale | None = None
    # When GPUs run out: a deployment that cannot place a replica may take GPUs from one of
    # lower priority above its autoscale min (server/placement/preempt.py). Shapes no engine: out
    # of template_hash.
    priority: int = 0
    # Its replicas' engines sleep (autoscale.sleep_when_idle, set by the autoscaler instead
    # of going to zero): state like `replicas`, out of template_hash; the running engines
    # are put to sleep and woken in place (server/reconcile/sleeping.py, agent/lifecycle/sleep.py).
    asleep: bool = False
    # The collective pre-flight each member runs before its engine: "required",
    # "best_effort", "off"; "" the default, required for a multi-node vLLM or SGLang
    # replica (the simulated engine's would need a torch it does not bring: asked for
    # only), none for one node (asked for only, on several GPUs: preflight_mode). Like
    # drain_timeout it shapes no engine: out of template_hash.
    preflight: str = ""
    preflight_timeout: float = 60.0
    preflight_min_busbw: float = 0.0  # GB/s at the largest size; 0: no floor
    # The engines publish their KV-cache events (vLLM's and SGLang's --kv-events-config)
    # to a loopback socket their agent binds. Off by default: the agent does not relay
    # them to routers yet, so on they cost the engine a little and route nothing. It
    # shapes the engine (a flag at start): in template_hash.
    kv_events: bool = False

    @property
    def gang(self) -> bool:
        return self.nodes > 1

    @property
    def preflight_mode(self) -> str:
        """The pre-flight its members run: "required", "best_effort" or "" (none).

        A gang's by default (required, but for the simulated engine). One node's only when
        the deployment asks for it and has GPUs to probe: tensor parallelism over several
        (its NVLink or PCIe path, all ranks on that node). One GPU on one node is accepted
        and runs none: an all-reduce over one rank moves no bytes, and a refusal would make
        a server refuse the stored deployments of a version that accepted it."""
        if self.gang:
            mode = self.preflight or ("off" if self.engine is EngineKind.SIMULATED else "required")
        else:
            mode = self.preflight if self.gpus_per_node > 1 else ""
        return "" if mode == "off" else mode

    @property
    def sleep_mode(self) -> bool:
        """Its engines start with vLLM's sleep mode (autoscale.sleep_when_idle)."""
        return self.autoscale is not None and self.autoscale.sleep_when_idle

    @property
    def lora_slots(self) -> int:
        """--max-loras of its engines; 0: LoRA not enabled."""
        if self.max_loras:
            return self.max_loras
        return DEFAULT_MAX_LORAS if self.adapters else 0

    def plain(self) -> dict[str, Any]:
        """The mapping a deployment file would hold for this deployment: the inverse of
        config/deployment.py's parse_deployment, and how a Deployment travels."""
        return {
            "name": self.name,
            "model": self.model,
            "engine": str(self.engine),
            "gpus_per_node": self.gpus_per_node,
            "replicas": self.replicas,
            "nodes": self.nodes,
            "served_name": self.served_name,
            "gpu_memory_min": self.gpu_memory_min,
            "selector": dict(self.selector),
            "args": list(self.args),
            "env": dict(self.env),
            "startup_timeout": self.startup_timeout,
            "strategy": str(self.strategy),
            "drain_timeout": self.drain_timeout,
            **self._plain_lora(),
            **({"autoscale": self.autoscale.plain()} if self.autoscale else {}),
            **({"priority": self.priority} if self.priority else {}),
            **({"asleep": True} if self.asleep else {}),
            **self._plain_preflight(),
            **({"kv_events": True} if self.kv_events else {}),
        }

    def _plain_preflight(self) -> dict[str, Any]:
        # Only what is set, as for LoRA: older shapes travel unchanged.
        out: dict[str, Any] = {}
        if self.preflight:
            out["preflight"] = self.preflight
        if self.preflight_timeout != 60.0:
            out["preflight_timeout"] = self.preflight_timeout
        if self.preflight_min_busbw:
            out["preflight_min_busbw"] = self.preflight_min_busbw
        return out

    def _plain_lora(self) -> dict[str, Any]:
        # Only what is set: a deployment without adapters travels as it did before them.
        out: dict[str, Any] = {}
        if self.adapters:
            out["adapters"] = [{"name": a.name, "path": a.path} for a in self.adapters]
        if self.max_loras:
            out["max_loras"] = self.max_loras
        if self.max_lora_rank != DEFAULT_MAX_LORA_RANK:
            out["max_lora_rank"] = self.max_lora_rank
        return out

    def template_hash(self) -> str:
        """Fingerprint of everything that shapes a replica (all but the replica count).

        Two specs with the same hash run the same engines; a change of hash rolls.
        """
        data = {
            "model": self.model,
            "served_name": self.served_name,
            "engine": str(self.engine),
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "gpu_memory_min": self.gpu_memory_min,
            "selector": sorted(self.selector.items()),
            "args": list(self.args),
            "env": sorted(self.env.items()),
            "startup_timeout": self.startup_timeout,
            "strategy": str(self.strategy),
        }
        # Keys only where LoRA is on, so that every hash from before adapters stands. Its
        # limits are fixed at start: enabling LoRA or changing them rolls. The adapters
        # themselves roll only engines that cannot load them at runtime (SGLang).
        if self.lora_slots:
            data["lora"] = [self.lora_slots, self.max_lora_rank]
            if self.engine not in RUNTIME_ADAPTERS:
                data["adapters"] = [[a.name, a.path] for a in self.adapters]
        # vLLM takes sleep mode only at start: the one autoscale setting that shapes the
        # engine. A key only when set, so that every hash from before stands.
        if self.sleep_mode:
            data["sleep_mode"] = True
        if self.kv_events:  # likewise: a key only when on
            data["kv_events"] = True
        raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:16]


class ReplicaState(enum.StrEnum):
    PENDING = "pending"  # not placed (unschedulable for now, reason given)
    # Placed; its members' launchers run the pre-flight probe (collective pre-flight) before the engines.
    PREFLIGHT = "preflight"
    STARTING = "starting"  # placed; engines not all ready yet
    READY = "ready"
    UNHEALTHY = "unhealthy"  # an engine answers badly
    BACKOFF = "backoff"  # exited or failed; restarts at backoff_until
    CRASH_LOOPING = "crash-looping"  # in backoff after repeated failures
    HELD = "held"  # on a lost node, re-placement held by the mass-loss guard
    # Leaving (scaled down, deleted, replaced): out of the routers' tables, its engines
    # still run until their requests finish (or drain_until), then it is stopped.
    DRAINING = "draining"


@frozen
class Member:
    """One node's part of a replica: its GPUs and the ports it binds."""

    node_id: str
    rank: int
    gpus: tuple[str, ...]  # GPU UUIDs
    port: int  # engine HTTP port on this node
    addr: str = ""  # the node's mgmt address at placement time
    # Gangs: the head's (rank 0) rendezvous and Ray GCS ports, copied onto every member.
    rendezvous_port: int = 0
    ray_port: int = 0
    ray_port_base: int = 0  # first of RAY_PORT_BLOCK ports on this node; 0: none
    hcas: tuple[str, ...] = ()  # the fabric's HCAs on this node
    # First of ENGINE_PORT_BLOCK ports on this node for the engine's internal ports; 0:
    # none (vLLM and SGLang members placed before the block existed, simulated engines).
    # An SGLang gang's rendezvous port lies inside the head's block.
    port_base: int = 0

    def bound_ports(self) -> tuple[int, ...]:
        """The ports this member occupies on its node, each once."""
        ports = [self.port]
        if self.rank == 0:
            ports += [p for p in (self.rendezvous_port, self.ray_port) if p]
        if self.port_base:
            ports += range(self.port_base, self.port_base + ENGINE_PORT_BLOCK)
        if self.ray_port_base:
            ports += range(self.ray_port_base, self.ray_port_base + RAY_PORT_BLOCK)
        return tuple(dict.fromkeys(ports))


@frozen
class Replica:
    id: str
    deployment: str
    index: int
    spec: Deployment  # the spec this replica was created from
    generation: int = 1
    members: tuple[Member, ...] = ()  # empty: not placed
    state: ReplicaState = ReplicaState.PENDING
    fabric: str = ""  # gangs: the fabric every member shares
    restarts: int = 0  # consecutive failed starts (reset once ready for a while)
    backoff_until: float = 0.0
    last_log_tail: tuple[str, ...] = ()
    reason: str = ""  # why pending / held / waiting, for status
    replaces: str = ""  # surge: the replica this one takes over from once ready
    ready_since: float = 0.0
    placed_at: float = 0.0
    # Draining: since when (routers drop it from their tables within a poll or two of
    # this), and the time it is stopped by even with requests still running.
    drain_since: float = 0.0
    drain_until: float = 0.0
    # A gang: the path at which every member held a complete copy of the model when it
    # was placed (GangSpec.weights_path); "": none, or not placed.
    gang_weights: str = ""

    @property
    def placed(self) -> bool:
        return bool(self.members)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(m.node_id for m in self.members)

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(g for m in self.members for g in m.gpus)

    @property
    def endpoint(self) -> str:
        """The head's engine URL; empty when not placed."""
        if not self.members:
            return ""
        head = self.members[0]
        return f"http://{head.addr}:{head.port}" if head.addr else ""

    def engine_specs(self) -> tuple[EngineSpec, ...]:
        """One EngineSpec per member, in rank order."""
        d = self.spec
        out = []
        head = self.members[0] if self.members else None
        for m in self.members:
            gang = None
            if d.nodes > 1 and head is not None:
                gang = GangSpec(
                    nnodes=d.nodes,
                    rank=m.rank,
                    head_addr=head.addr,
                    rendezvous_port=head.rendezvous_port,
                    hcas=m.hcas,
                    ray_port=head.ray_port,
                    ray_port_base=m.ray_port_base,
                    preflight=d.preflight_mode,
                    preflight_timeout=d.preflight_timeout,
                    preflight_min_busbw=d.preflight_min_busbw,
                    weights_path=self.gang_weights,
                )
            out.append(
                EngineSpec(
                    replica_id=self.id,
                    generation=self.generation,
                    deployment=self.deployment,
                    model=d.model,
                    served_name=d.served_name,
                    engine=d.engine,
                    gpus=m.gpus,
                    port=m.port,
                    tensor_parallel=d.gpus_per_node,
                    port_base=m.port_base,
                    args=d.args,
                    env=dict(d.env),
                    startup_timeout=d.startup_timeout,
                    gang=gang,
                    origin=d.plain(),
                    adapters=d.adapters,
                    max_loras=d.lora_slots,
                    max_lora_rank=d.max_lora_rank,
                    sleep_mode=d.sleep_mode,
                    asleep=d.asleep,
                    kv_events=d.kv_events,
                    **(_single_preflight(d) if gang is None else {}),
                )
            )
        return tuple(out)


def _single_preflight(d: Deployment) -> dict[str, Any]:
    """A one-node replica's pre-flight settings for its EngineSpec (a gang's ride in
    GangSpec); none where it runs none, so that such specs stay as they were."""
    mode = d.preflight_mode
    if not mode:
        return {}
    return {"preflight": mode, "preflight_timeout": d.preflight_timeout,
            "preflight_min_busbw": d.preflight_min_busbw}


def replica_id(deployment: str, index: int) -> str:
    return f"{deployment}-{index}"
