"""Engine specs (what the server wants run) and engine reports (what the agent runs)."""

from __future__ import annotations

import enum
import re
from typing import Any

from attrs import field, frozen

# An engine key as it goes into an HTTP header: RFC 6750's b64token characters, bounded.
# A peer's CR or LF here would write headers of its own into a router's upstream request.
ENGINE_KEY_MAX = 128
_ENGINE_KEY = re.compile(r"[A-Za-z0-9._~+/=-]*")


def check_engine_key(value: object) -> None:
    """ValueError unless `value` is a key a header may carry ("" included: none)."""
    if not isinstance(value, str):
        raise ValueError(f"an engine key is a string, not {type(value).__name__}")
    if len(value) > ENGINE_KEY_MAX or not _ENGINE_KEY.fullmatch(value):
        raise ValueError(f"not an engine key (at most {ENGINE_KEY_MAX} of A-Z a-z 0-9 . _ ~ + / = -)")


class EngineKind(enum.StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    SIMULATED = "simulated"


# Engines that load and unload LoRA adapters while they run (vLLM's /v1/load_lora_adapter
# and /v1/unload_lora_adapter, and the simulated engine that copies them): an adapter
# added to or removed from a deployment changes no engine of theirs. SGLang's are given
# their adapters at start (--lora-paths), so a change rolls them.
RUNTIME_ADAPTERS = frozenset({EngineKind.VLLM, EngineKind.SIMULATED})

# vLLM's defaults (vllm 0.32 config/lora.py LoRAConfig): a rank above max_lora_rank is
# refused at load; max_loras adapters share one batch, more wait in the CPU cache.
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16
# vLLM's MaxLoRARanks (config/lora.py): --max-lora-rank takes only these.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@frozen
class Adapter:
    """A LoRA adapter of a deployment: the name clients ask for, a folder the nodes see."""

    name: str
    path: str  # absolute, like a model's local copy


@frozen
class GangSpec:
    """This member's part in a multi-node replica."""

    nnodes: int
    rank: int
    head_addr: str  # rank 0's mgmt address
    rendezvous_port: int  # vLLM --master-port / SGLang --dist-init-addr port
    hcas: tuple[str, ...] = ()  # the fabric's HCAs on this node, for NCCL_IB_HCA
    ray_port: int = 0  # GCS port of this replica's own Ray cluster (launch_mode ray)
    # First of a block of ports on this node reserved for this replica's Ray processes.
    ray_port_base: int = 0
    # The pre-flight before the engine (collective pre-flight, agent/engines/preflight.py): "required"
    # (the engine starts only if the probe passed), "best_effort" (it starts anyway) or ""
    # (none). Bounded by preflight_timeout seconds; below preflight_min_busbw GB/s of bus
    # bandwidth the probe fails (0: correctness and time only).
    preflight: str = ""
    preflight_timeout: float = 60.0
    preflight_min_busbw: float = 0.0
    # A path at which every member's storage scan, as the server saw them at placement,
    # held a complete copy of the model (server/placement/gang_weights.py). A Ray gang's
    # head may start on it although it is local: every worker finds a whole copy there.
    # The agent uses it only where its own scan holds it complete. "": none (or a server
    # from before, which does not send the key): only a shared copy qualifies.
    weights_path: str = ""


@frozen
class EngineSpec:
    replica_id: str
    generation: int
    deployment: str
    model: str  # "org/name" id or absolute path
    served_name: str
    engine: EngineKind
    gpus: tuple[str, ...]  # GPU UUIDs placed on this node
    port: int  # engine HTTP port
    tensor_parallel: int = 1
    # First of ENGINE_PORT_BLOCK ports (llmgw.model.deployment) on this node reserved for
    # the engine's own internal ports (vLLM's VLLM_PORT, SGLang's --nccl-port and
    # dist-init ports); 0: none reserved (a spec from a server before the block existed),
    # and the engine picks its own as it did then.
    port_base: int = 0
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(factory=dict)
    startup_timeout: float = 600.0  # seconds
    gang: GangSpec | None = None
    # A single-node tensor-parallel replica's pre-flight (collective pre-flight), as GangSpec's fields
    # are a gang member's: "required", "best_effort" or "" (none; always "" on a gang
    # member, whose own is in `gang`).
    preflight: str = ""
    preflight_timeout: float = 60.0
    preflight_min_busbw: float = 0.0
    # The deployment this engine was made from, as its file would hold it. The agent keeps
    # it in the engine's record and sends it back at Hello, so that a server that lost its
    # state can rebuild the deployment, template and all, without restarting the engine.
    origin: dict[str, Any] = field(factory=dict)
    # The server state that issued it (a random id kept in the state folder; "" from
    # before there was one): an engine of another state is a lost state's, not one this
    # state stopped on purpose.
    issuer: str = ""
    # LoRA adapters the engine should serve. max_loras above 0: it starts with LoRA
    # enabled (max_loras adapters per batch, ranks up to max_lora_rank); 0: without. On an
    # engine of RUNTIME_ADAPTERS the agent loads and unloads `adapters` as the list
    # changes, without a restart.
    adapters: tuple[Adapter, ...] = ()
    max_loras: int = 0
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    # vLLM's sleep mode (autoscale.sleep_when_idle): --enable-sleep-mode at start, and
    # VLLM_SERVER_DEV_MODE=1, without which vLLM serves no /sleep or /wake_up.
    sleep_mode: bool = False
    # Wanted asleep now (POST /sleep; False: POST /wake_up): changes in place, same
    # generation, as the adapters do.
    asleep: bool = False
    # The engine publishes its KV-cache events (Deployment.kv_events): --kv-events-config
    # pointed at loopback ports of its block (KV_EVENTS_PUB, KV_EVENTS_REPLAY), on the
    # rank that runs the scheduler.
    kv_events: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.replica_id, self.generation)


# EngineReport.preflight while the member's launcher runs the probe.
PREFLIGHT_RUNNING = "running"


class EngineState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    FAILED = "failed"  # never became ready within its startup timeout
    STOPPING = "stopping"
    EXITED = "exited"  # the process is gone (crash, or stopped on request)


@frozen
class EngineReport:
    replica_id: str
    generation: int
    state: EngineState
    endpoint: str = ""  # "http://mgmt_addr:port"
    pid: int = 0
    exit_code: int | None = None
    reason: str = ""
    log_tail: tuple[str, ...] = ()
    restarts: int = 0
    # Non-zero: the engine could not have this port on the node (taken before the start,
    # or answered by a process outside the engine's session). The server stops assigning
    # it there; `reason` names the holder where the agent could see it.
    conflict_port: int = 0
    # At Hello, a live engine's report carries the spec it runs (see EngineSpec.origin).
    spec: EngineSpec | None = None
    # The weights the engine loads, one line: which copy (path, local or shared, the
    # store) or where it downloads. "": not told (an agent from before, a custom plan).
    weights: str = ""
    # Requests the engine has running or waiting, from its own /metrics (vLLM's
    # num_requests_running + num_requests_waiting, SGLang's num_running_reqs +
    # num_queue_reqs), as of the agent's last report: it sends one each time the count
    # goes between none and some, so 0 is the engine's state now, and a figure above 0
    # says "busy" rather than how busy. -1: not known (not ready yet, no such metrics, an
    # agent from before). A draining replica stops early only on 0 (server/reconcile/drain.py).
    in_flight: int = -1
    # Names of the LoRA adapters the engine has loaded (the router sends an adapter's
    # requests only where it is loaded), and "name: why" for each it could not load.
    adapters: tuple[str, ...] = ()
    adapter_errors: tuple[str, ...] = ()
    # The pre-flight before the engine (collective pre-flight), one line: "" (none asked, or an agent
    # from before), "running", "passed: gloo x2, 4 MiB at 1.15 GB/s bus bandwidth, in
    # 2.0s" or "failed: <why>" (agent/lifecycle/preflight_report.py); and the passed probe's bus
    # bandwidth at its largest size, GB/s (0: none measured).
    preflight: str = ""
    preflight_busbw_gbps: float = 0.0
    # While the engine downloads its weights into download_dir (no copy on the node), the
    # bytes on disk so far and the rate, one line: "12.3 GB on disk, 210 MB/s"
    # (agent/lifecycle/download_progress.py). "": no download, or an agent from before.
    download: str = ""
    # The engine's own API key (engine keys): what a router sends it as `Authorization:
    # Bearer`, over CURVE from the server's endpoint table. "": none (an engine that
    # serves no HTTP, an agent from before). Never in a repr (log lines).
    api_key: str = field(default="", validator=lambda _, __, v: check_engine_key(v), repr=False)
