"""The agent's configuration (conf/agent.yaml). Shapes only here; loading in load_agent.py.

Durations are float seconds once loaded; files say `500ms`, `5s`, `1m`.
"""

from __future__ import annotations

from attrs import field, frozen

from llmgw.config.addresses import Addresses, to_addresses
from llmgw.config.duration import Duration


@frozen
class KeysConfig:
    secret_key: str  # this node's secret key file (`llmgw keys issue node` wrote it)
    server_key: str  # the server's public key file


@frozen
class FabricConfig:
    name: str
    hcas: tuple[str, ...]
    rate_gbps: float = 0.0  # 0: not stated, nothing to compare


@frozen
class DiscoveryConfig:
    nvidia_smi: str = ""  # empty: look it up on PATH
    ib_root: str = "/sys/class/infiniband"
    prefer_nvml: bool = True
    skip_gpus: bool = False
    # Where no GPU source answers (no NVML, no nvidia-smi): report this many simulated
    # GPUs instead, for trying llmgw without GPUs. 0: never.
    simulated_gpus: int = 0
    # How often discovery runs again after start (seconds).
    interval: Duration = 60.0
    # How often the labelled HCAs' ports are read (state, error counters), and how long a
    # port must stay ACTIVE with quiet counters before it counts again (hca_watch.py).
    hca_interval: Duration = 2.0
    hca_quiet: Duration = 30.0


@frozen
class ModelDirConfig:
    path: str
    shared: bool | None = None  # None: detect from /proc/self/mountinfo
    store: str = ""  # operator-given store name; overrides the mount source


@frozen
class VllmConfig:
    bin: str = "vllm"
    launch_mode: str = "ray"  # "ray" or "mp"
    ray_bin: str = "ray"


@frozen
class SglangConfig:
    python: str = "python3"


@frozen
class EnginesConfig:
    vllm: VllmConfig = VllmConfig()
    sglang: SglangConfig = SglangConfig()
    # The simulated engine: python interpreter used for `-m llmgw.simengine`.
    # Empty: the interpreter running the agent.
    simulated_python: str = ""
    # The pre-flight probe before a gang member's engine (collective pre-flight). Empty: llmgw's own
    # probe, run by the engine's own Python (vllm's #! interpreter, sglang.python). Set,
    # the probe script or interpreter to use instead: a test double, or a Python with
    # torch for the simulated engine.
    preflight_probe: str = ""
    preflight_python: str = ""


@frozen
class SupervisorConfig:
    work_dir: str = "/var/lib/llmgw-agent"
    log_lines: int = 512
    stop_timeout: Duration = 60.0
    health_interval: Duration = 2.0  # between one /health probe's end and the next
    # How long one /health probe may take. SGLang's /health generates a token and waits
    # for it up to its own SGLANG_HEALTH_CHECK_TIMEOUT (20 s): for SGLang the probe waits
    # at least 25 s, or that variable + 5 s where the deployment sets it.
    health_timeout: Duration = 10.0
    # Hard cap on a start that keeps showing progress (its log grows): see
    # agent/lifecycle/startup_deadline.py.
    startup_max: Duration = 3600.0
    # How long a stopped engine's GPUs may take to give their memory back before the
    # stuck process is named; they stay out of placement until it is back, even past it.
    release_timeout: Duration = 120.0
    log_max_bytes: int = 64 * 1024 * 1024  # rotate engine.log past this size


@frozen
class AgentConfig:
    node_id: str
    # tcp://host:port, or a list of them (several servers: the one that leads answers).
    server: Addresses = field(converter=to_addresses)
    keys: KeysConfig
    mgmt_addr: str
    mgmt_interface: str = ""
    labels: dict[str, str] = field(factory=dict)
    heartbeat_interval: Duration = 5.0
    reconnect_base: Duration = 1.0
    reconnect_max: Duration = 30.0
    fabrics: tuple[FabricConfig, ...] = ()
    discovery: DiscoveryConfig = DiscoveryConfig()
    # None: never asked to look. An empty tuple cannot be written (it is an error).
    model_dirs: tuple[ModelDirConfig, ...] | None = None
    # Where an engine downloads weights this node holds no complete copy of (HF_HUB_CACHE;
    # vLLM's --download-dir). None (unset): the loader takes the first writable model_dirs
    # entry, so the next scan sees the finished copy. "": the engine's own default cache.
    download_dir: str | None = None
    engines: EnginesConfig = EnginesConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    # Inclusive range the server assigns this node's engine and rendezvous ports from.
    port_range: tuple[int, int] = (20000, 29999)
    # host:port of the HTTP listener with /metrics (Prometheus). Empty: no listener.
    metrics_bind: str = "127.0.0.1:9465"
    # The port on mgmt_addr where routers follow this node's engines' KV-cache events
    # (kv_aware routing): a CURVE ROUTER socket that admits only the router keys the
    # server hands this agent. 0: no relay socket, and none is advertised.
    kv_relay_port: int = 7444
    # Where the config was read from, for messages.
    source: str = ""
