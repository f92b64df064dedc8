"""Ray for vLLM's `launch_mode: ray`: one Ray cluster per replica.

Several replicas' Ray clusters may share a node, so every replica's Ray processes get
their own ports (a block from GangSpec.ray_port_base, laid out below) and their own
temp dir (<work_dir>/engines/<replica>/ray, or a short one when that path is too long
for Ray's Unix sockets: see `ray_temp_dir`). `ray stop` is never used: it kills every
Ray process on the host by name; the supervisor stops by session instead.

Flags checked against `ray start --help` of Ray 2.60.0, and run for real on loopback by
tests/integration/test_ray.py.
"""

from __future__ import annotations

import hashlib
import posixpath
import re

from llmgw.config.agent import AgentConfig
from llmgw.errors import EngineError
from llmgw.model.deployment import RAY_PORT_BLOCK
from llmgw.model.engine import GangSpec

# Offsets in the block of ports the server reserves from GangSpec.ray_port_base.
NODE_MANAGER = 0
OBJECT_MANAGER = 1
METRICS_EXPORT = 2
DASHBOARD_AGENT_GRPC = 3
DASHBOARD_AGENT_LISTEN = 4
RUNTIME_ENV_AGENT = 5
RAY_CLIENT_SERVER = 6  # head only
DASHBOARD = 7  # head only; the dashboard itself is off
WORKERS_FIRST = 16
# Size of the block placement reserves per replica member (ports base .. base+63): one
# constant, in the model, shared with placement.
RAY_PORT_BLOCK_SIZE = RAY_PORT_BLOCK

# `ray start --num-cpus`: Ray otherwise counts every core of the host, prestarts and pools
# that many worker processes, each binding a worker port (a 200-core host would want more
# than the block holds). vLLM's GPU workers ask for num_cpus=0 (vLLM 0.32,
# v1/executor/ray_executor.py and ray_executor_v2.py; placement bundles {"GPU": 1} only),
# so CPUs are for Ray's own tasks and vLLM's data-parallel engine actor ({"CPU": 1} per DP
# rank, v1/engine/utils.py): the member's GPU count plus this margin, from nothing but the spec.
RAY_CPU_MARGIN = 2
# Worker ports beyond one per pooled worker (num_cpus) and one per GPU actor (actors with
# num_cpus=0 run in worker processes of their own): the driver and workers being replaced.
RAY_WORKER_SLACK = 4


def ray_num_cpus(num_gpus: int) -> int:
    return num_gpus + RAY_CPU_MARGIN


def ray_worker_ports(num_gpus: int) -> int:
    """How many worker ports a member with `num_gpus` GPUs gets (--min/--max-worker-port)."""
    return ray_num_cpus(num_gpus) + num_gpus + RAY_WORKER_SLACK


# The most GPUs one member's Ray block has worker ports for.
RAY_MAX_GPUS = (RAY_PORT_BLOCK - WORKERS_FIRST - RAY_CPU_MARGIN - RAY_WORKER_SLACK) // 2


# Ray puts its Unix sockets at <temp_dir>/session_<date>_<time>_<usec>_<pid>/sockets/
# plasma_store (and .../raylet), and refuses to start when such a path passes 107 bytes
# (AF_UNIX). The session name is up to 42 bytes (a 7-digit pid), "/sockets/plasma_store"
# 21 more, with room for a ".N" suffix: the temp dir itself gets at most this many bytes.
RAY_TEMP_DIR_MAX = 40
# Where a temp dir goes when <engine dir>/ray is too long (Ray's own default is /tmp/ray).
SHORT_TEMP_ROOT = "/tmp"


def ray_temp_dir(engine_dir: str) -> str:
    """This member's Ray --temp-dir: <engine dir>/ray when it fits in RAY_TEMP_DIR_MAX,
    else /tmp/llmgw-ray-<hash of the engine dir>, the same for the same engine dir."""
    wanted = posixpath.join(engine_dir, "ray")
    if len(wanted.encode()) <= RAY_TEMP_DIR_MAX:
        return wanted
    digest = hashlib.sha256(engine_dir.encode()).hexdigest()[:16]
    return posixpath.join(SHORT_TEMP_ROOT, f"llmgw-ray-{digest}")


def ray_address(gang: GangSpec) -> str:
    return f"{gang.head_addr}:{gang.ray_port}"


def _port_flags(base: int, head: bool, num_gpus: int) -> tuple[str, ...]:
    workers = ray_worker_ports(num_gpus)
    if WORKERS_FIRST + workers > RAY_PORT_BLOCK_SIZE:
        raise EngineError(
            f"a Ray member with {num_gpus} GPUs needs {workers} worker ports; its block of "
            f"{RAY_PORT_BLOCK_SIZE} holds {RAY_PORT_BLOCK_SIZE - WORKERS_FIRST} (at most {RAY_MAX_GPUS} GPUs)"
        )
    flags = [
        f"--node-manager-port={base + NODE_MANAGER}",
        f"--object-manager-port={base + OBJECT_MANAGER}",
        f"--metrics-export-port={base + METRICS_EXPORT}",
        f"--dashboard-agent-grpc-port={base + DASHBOARD_AGENT_GRPC}",
        f"--dashboard-agent-listen-port={base + DASHBOARD_AGENT_LISTEN}",
        f"--runtime-env-agent-port={base + RUNTIME_ENV_AGENT}",
        f"--min-worker-port={base + WORKERS_FIRST}",
        f"--max-worker-port={base + WORKERS_FIRST + workers - 1}",
    ]
    if head:
        flags += [
            f"--ray-client-server-port={base + RAY_CLIENT_SERVER}",
            f"--dashboard-port={base + DASHBOARD}",
            "--include-dashboard=false",
        ]
    return tuple(flags)


# Seconds `ray start --block` drains its node on SIGTERM before tearing down (Ray 2.60
# default 30); the plan sets 0 for Ray's processes unless the deployment's env says otherwise.
RAY_DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"

CLIENT_SERVER_FLAG = "--ray-client-server-port="


def without_client_server_port(argv: tuple[str, ...]) -> tuple[str, ...]:
    """`ray start` argv without --ray-client-server-port.

    The flag keeps the head's Ray Client server (default 10001) inside the replica's own
    block, so two heads on one node do not collide. Ray 2.60 refuses the flag outright
    ("Ray Client requires pip package `ray[client]`") where grpcio is not installed, and
    starts no client server there anyway: the launcher drops it in that case.
    """
    return tuple(a for a in argv if not a.startswith(CLIENT_SERVER_FLAG))


def ray_start_argv(gang: GangSpec, config: AgentConfig, temp_dir: str, num_gpus: int) -> tuple[str, ...]:
    """`ray start --head ...` for rank 0, `ray start --address head:port ...` otherwise."""
    ray = config.engines.vllm.ray_bin
    if gang.rank == 0:
        where: tuple[str, ...] = ("--head", f"--port={gang.ray_port}")
    else:
        where = (f"--address={ray_address(gang)}",)
    return (
        ray,
        "start",
        *where,
        f"--node-ip-address={config.mgmt_addr}",
        f"--num-gpus={num_gpus}",
        f"--num-cpus={ray_num_cpus(num_gpus)}",
        f"--temp-dir={temp_dir}",
        *_port_flags(gang.ray_port_base, head=gang.rank == 0, num_gpus=num_gpus),
        "--disable-usage-stats",
        "--block",
    )


def ray_status_argv(gang: GangSpec, config: AgentConfig) -> tuple[str, ...]:
    return (config.engines.vllm.ray_bin, "status", f"--address={ray_address(gang)}")


_NODE_LINE = re.compile(r"^\s*(\d+)\s+node_\S+")


# The sections of "Node status" whose nodes are alive and joined: Ray's autoscaler lists
# a node with work under "Active:" and one without under "Idle:" (a worker that has just
# joined, before vLLM's placement group is made, is idle). "Pending:" nodes are not up.
_ALIVE_SECTIONS = ("Active:", "Idle:")


def count_ray_nodes(status_output: str) -> int:
    """Alive nodes in `ray status` output: the lines of the "Active:" and "Idle:"
    sections of "Node status"."""
    count = 0
    counting = False
    for line in status_output.splitlines():
        stripped = line.strip()
        if stripped in _ALIVE_SECTIONS:
            counting = True
            continue
        if counting:
            m = _NODE_LINE.match(line)
            if m:
                count += int(m.group(1))
            elif stripped.endswith(":") or stripped.startswith("("):
                counting = False
    return count
