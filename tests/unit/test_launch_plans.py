"""Launch plans, argv by argv, for every engine kind x single/mp/ray x rank."""

from __future__ import annotations

import attrs
import pytest

from llmgw.agent.engines import RAY_PORT_BLOCK_SIZE, build_plan, count_ray_nodes, env_overrides
from llmgw.agent.engines.ray import without_client_server_port
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SglangConfig, VllmConfig
from llmgw.errors import ConfigError, EngineError
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec

GPUS = ("GPU-aaaa", "GPU-bbbb")
WORK = "/var/lib/llmgw-agent"
CWD = "/var/lib/llmgw-agent/engines/r1"


def config(mode: str = "mp", simulated_python: str = "") -> AgentConfig:
    return AgentConfig(
        node_id="n1",
        server="tcp://10.0.0.9:5555",
        keys=KeysConfig("s", "p"),
        mgmt_addr="10.0.0.2",
        mgmt_interface="eno1",
        engines=EnginesConfig(
            vllm=VllmConfig(bin="/opt/vllm/bin/vllm", launch_mode=mode, ray_bin="/opt/vllm/bin/ray"),
            sglang=SglangConfig(python="/opt/sglang/bin/python"),
            simulated_python=simulated_python,
        ),
    )


def spec(kind: EngineKind = EngineKind.VLLM, rank: int | None = None, **kw: object) -> EngineSpec:
    gang = None
    if rank is not None:
        gang = GangSpec(
            nnodes=2,
            rank=rank,
            head_addr="10.0.0.1",
            rendezvous_port=29600,
            hcas=("mlx5_0", "mlx5_1"),
            ray_port=26379,
            ray_port_base=27000,
        )
    base = EngineSpec(
        replica_id="r1",
        generation=3,
        deployment="llama",
        model="org/llama",
        served_name="llama",
        engine=kind,
        gpus=GPUS,
        port=20001,
        tensor_parallel=2,
        args=("--max-model-len", "8192"),
        gang=gang,
    )
    return attrs.evolve(base, **kw)  # type: ignore[arg-type]


SINGLE_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}
MULTI_ENV = {
    **SINGLE_ENV,
    "NCCL_SOCKET_IFNAME": "eno1",
    "GLOO_SOCKET_IFNAME": "eno1",
    "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
    "VLLM_HOST_IP": "10.0.0.2",
}
SERVE = ("--host", "10.0.0.2", "--port", "20001", "--served-model-name", "llama")


def test_vllm_single_node() -> None:
    plan = build_plan(spec(), config(), WORK)
    assert len(plan.processes) == 1
    p = plan.main
    assert p.argv == (
        "/opt/vllm/bin/vllm", "serve", "org/llama", *SERVE,
        "--tensor-parallel-size", "2", "--max-model-len", "8192",
    )  # fmt: skip
    assert p.env == SINGLE_ENV and p.cwd == CWD
    assert plan.health_checked and plan.wait_for_ray_nodes == 0 and plan.env_overrides == ()


MP_TAIL = (
    "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
    "--distributed-executor-backend", "mp", "--nnodes", "2",
)  # fmt: skip


def test_vllm_mp_rank0() -> None:
    plan = build_plan(spec(rank=0), config("mp"), WORK)
    assert plan.main.argv == (
        "/opt/vllm/bin/vllm", "serve", "org/llama", *SERVE, *MP_TAIL,
        "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29600",
        "--max-model-len", "8192",
    )  # fmt: skip
    assert plan.main.env == MULTI_ENV and plan.health_checked


def test_vllm_mp_rank1_headless() -> None:
    plan = build_plan(spec(rank=1), config("mp"), WORK)
    assert plan.main.argv == (
        "/opt/vllm/bin/vllm", "serve", "org/llama", *MP_TAIL,
        "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29600",
        "--headless", "--max-model-len", "8192",
    )  # fmt: skip
    assert plan.main.env == MULTI_ENV and not plan.health_checked


def _ray_ports(head: bool) -> tuple[str, ...]:
    ports = (
        "--node-manager-port=27000", "--object-manager-port=27001",
        "--metrics-export-port=27002", "--dashboard-agent-grpc-port=27003",
        "--dashboard-agent-listen-port=27004", "--runtime-env-agent-port=27005",
        "--min-worker-port=27016", f"--max-worker-port={27000 + RAY_PORT_BLOCK_SIZE - 1}",
    )  # fmt: skip
    if head:
        ports += (
            "--ray-client-server-port=27006", "--dashboard-port=27007",
            "--include-dashboard=false",
        )  # fmt: skip
    return ports


def test_vllm_ray_head() -> None:
    plan = build_plan(spec(rank=0), config("ray"), WORK)
    head, serve = plan.processes
    assert head.name == "ray-head" and serve.name == "engine"
    assert head.argv == (
        "/opt/vllm/bin/ray", "start", "--head", "--port=26379",
        "--node-ip-address=10.0.0.2", "--num-gpus=2", f"--temp-dir={CWD}/ray",
        *_ray_ports(head=True), "--disable-usage-stats", "--block",
    )  # fmt: skip
    assert serve.argv == (
        "/opt/vllm/bin/vllm", "serve", "org/llama", *SERVE,
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
        "--distributed-executor-backend", "ray", "--max-model-len", "8192",
    )  # fmt: skip
    assert head.env == {**MULTI_ENV, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    assert serve.env == {**MULTI_ENV, "RAY_ADDRESS": "10.0.0.1:26379"}
    assert plan.wait_for_ray_nodes == 2 and plan.ray_address == "10.0.0.1:26379"
    assert plan.ray_status_argv == ("/opt/vllm/bin/ray", "status", "--address=10.0.0.1:26379")
    assert plan.health_checked


def test_vllm_ray_worker() -> None:
    plan = build_plan(spec(rank=1), config("ray"), WORK)
    (worker,) = plan.processes
    assert worker.name == "ray-worker"
    assert worker.argv == (
        "/opt/vllm/bin/ray", "start", "--address=10.0.0.1:26379",
        "--node-ip-address=10.0.0.2", "--num-gpus=2", f"--temp-dir={CWD}/ray",
        *_ray_ports(head=False), "--disable-usage-stats", "--block",
    )  # fmt: skip
    assert worker.env == {**MULTI_ENV, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"} and worker.cwd == CWD
    assert not plan.health_checked and plan.wait_for_ray_nodes == 0


def _temp_dir(argv: tuple[str, ...]) -> str:
    (arg,) = [a for a in argv if a.startswith("--temp-dir=")]
    return arg.split("=", 1)[1]


def test_vllm_ray_temp_dir_short_enough_for_unix_sockets() -> None:
    # Ray's sockets live at <temp>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store,
    # at most 107 bytes: a long work dir or replica id gets a short temp dir of its own.
    long_id = "llama-3-70b-instruct-0"
    plans = [build_plan(spec(rank=r, replica_id=long_id), config("ray"), WORK) for r in (0, 1)]
    dirs = [_temp_dir(p.processes[0].argv) for p in plans]
    assert dirs[0] == dirs[1]  # same work dir and replica: the same dir
    assert dirs[0].startswith("/tmp/llmgw-ray-") and len(dirs[0]) <= 40
    worst = f"{dirs[0]}/session_2026-12-02_11-56-18_263880_4194304/sockets/plasma_store.1"
    assert len(worst) <= 107
    other = build_plan(spec(rank=0, replica_id=long_id), config("ray"), "/srv/llmgw-agent-other")
    assert _temp_dir(other.processes[0].argv) != dirs[0]
    # A short one stays in the engine's own folder.
    assert _temp_dir(build_plan(spec(rank=0), config("ray"), WORK).processes[0].argv) == f"{CWD}/ray"


def test_vllm_ray_drain_timeout_deployment_wins() -> None:
    s = spec(rank=1)
    s = attrs.evolve(s, env={**s.env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "5"})
    (worker,) = build_plan(s, config("ray"), WORK).processes
    assert worker.env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "5"


def test_without_client_server_port() -> None:
    head = build_plan(spec(rank=0), config("ray"), WORK).processes[0].argv
    bare = without_client_server_port(head)
    assert "--ray-client-server-port=27006" in head
    assert bare == tuple(a for a in head if a != "--ray-client-server-port=27006")
    assert without_client_server_port(bare) == bare


def test_vllm_ray_needs_ports() -> None:
    s = spec(rank=0)
    assert s.gang is not None
    s = attrs.evolve(s, gang=attrs.evolve(s.gang, ray_port=0))
    with pytest.raises(EngineError, match="ray_port"):
        build_plan(s, config("ray"), WORK)


def test_vllm_bad_launch_mode() -> None:
    with pytest.raises(ConfigError, match="launch_mode"):
        build_plan(spec(rank=0), config("slurm"), WORK)
    # A single-node replica does not care.
    assert build_plan(spec(), config("slurm"), WORK).main.argv[1] == "serve"


SG = (
    "/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "org/llama",
    "--served-model-name", "llama", "--host", "10.0.0.2", "--port", "20001",
)  # fmt: skip


def test_sglang_single_node() -> None:
    plan = build_plan(spec(EngineKind.SGLANG), config(), WORK)
    assert plan.main.argv == (*SG, "--tp-size", "2", "--max-model-len", "8192")
    assert plan.main.env == SINGLE_ENV and plan.health_checked


@pytest.mark.parametrize("rank", [0, 1])
def test_sglang_multi_node(rank: int) -> None:
    plan = build_plan(spec(EngineKind.SGLANG, rank=rank), config(), WORK)
    # SGLang's --tp counts the whole replica: 2 GPUs per node x 2 nodes.
    assert plan.main.argv == (
        *SG, "--tp-size", "4", "--nnodes", "2", "--node-rank", str(rank),
        "--dist-init-addr", "10.0.0.1:29600", "--max-model-len", "8192",
    )  # fmt: skip
    assert plan.main.env == MULTI_ENV
    assert plan.health_checked is (rank == 0)  # other ranks: a dummy health server


def test_simulated_single_and_mp() -> None:
    plan = build_plan(spec(EngineKind.SIMULATED), config(), WORK, python="/usr/bin/python3")
    assert plan.main.argv == (
        "/usr/bin/python3", "-m", "llmgw.simengine", "serve", "org/llama", *SERVE,
        "--tensor-parallel-size", "2", "--max-model-len", "8192",
    )  # fmt: skip
    plan = build_plan(spec(EngineKind.SIMULATED, rank=1), config("mp", "/sim/py"), WORK, python="x")
    assert plan.main.argv == (
        "/sim/py", "-m", "llmgw.simengine", "serve", "org/llama", *MP_TAIL,
        "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29600",
        "--headless", "--max-model-len", "8192",
    )  # fmt: skip


def test_simulated_gang_is_mp_shaped_even_where_vllm_uses_ray() -> None:
    # The simulated engine's gang rendezvous is mp-shaped; it never needs Ray installed.
    # (To run the real Ray plan without GPUs, point engines.vllm.bin at the simulator.)
    plan = build_plan(spec(EngineKind.SIMULATED, rank=0), config("ray"), WORK, python="py")
    assert len(plan.processes) == 1
    assert plan.main.argv[:5] == ("py", "-m", "llmgw.simengine", "serve", "org/llama")
    assert "--master-port" in plan.main.argv
    argv = plan.main.argv
    assert argv[argv.index("--distributed-executor-backend") + 1] == "mp"


def test_simulated_needs_an_interpreter() -> None:
    with pytest.raises(ConfigError, match="simulated_python"):
        build_plan(spec(EngineKind.SIMULATED), config(), WORK)


def test_deployment_env_wins_and_is_reported() -> None:
    s = spec(rank=0, env={"NCCL_SOCKET_IFNAME": "bond0", "NCCL_DEBUG": "INFO"})
    plan = build_plan(s, config("mp"), WORK)
    assert plan.main.env == {**MULTI_ENV, "NCCL_SOCKET_IFNAME": "bond0", "NCCL_DEBUG": "INFO"}
    assert plan.env_overrides == ("NCCL_SOCKET_IFNAME",)
    assert env_overrides(s, config("mp")) == ("NCCL_SOCKET_IFNAME",)
    # Same value: nothing was overridden.
    same = spec(env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert build_plan(same, config(), WORK).env_overrides == ()


def test_ray_address_override_by_deployment() -> None:
    s = spec(rank=0, env={"RAY_ADDRESS": "10.9.9.9:1"})
    serve = build_plan(s, config("ray"), WORK).main
    assert serve.env["RAY_ADDRESS"] == "10.9.9.9:1"


def test_no_interface_no_hcas() -> None:
    cfg = attrs.evolve(config("mp"), mgmt_interface="")
    s = spec(rank=0)
    assert s.gang is not None
    s = attrs.evolve(s, gang=attrs.evolve(s.gang, hcas=()))
    assert build_plan(s, cfg, WORK).main.env == {**SINGLE_ENV, "VLLM_HOST_IP": "10.0.0.2"}


@pytest.mark.parametrize("replica", ["", "..", "a/b"])
def test_bad_replica_id(replica: str) -> None:
    with pytest.raises(EngineError):
        build_plan(spec(replica_id=replica), config(), WORK)


def test_rank_outside_gang() -> None:
    s = spec(rank=0)
    assert s.gang is not None
    with pytest.raises(EngineError, match="rank 2"):
        build_plan(attrs.evolve(s, gang=attrs.evolve(s.gang, rank=2)), config(), WORK)


def test_plans_are_pure_and_frozen() -> None:
    a = build_plan(spec(rank=0), config("ray"), WORK)
    assert a == build_plan(spec(rank=0), config("ray"), WORK)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.main.argv = ()  # type: ignore[misc]


RAY_STATUS = """\
======== Autoscaler status: 2026-01-01 10:00:00.000000 ========
Node status
---------------------------------------------------------------
Active:
 1 node_3f0c2a1b
 1 node_9d8e7f6a
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Usage:
 0.0/4.0 GPU
"""


# `ray status` of Ray 2.60.0, from a real two-node cluster on loopback (tests/integration/test_ray.py).
RAY_STATUS_2_60 = """\
======== Autoscaler status: 2026-12-02 11:58:16.825604 ========
Node status
---------------------------------------------------------------
Active:
 1 node_06ad0cf8a6142ce7861fc46783ef11dbc4850436b197033f16a45690
 1 node_7b9dcbe90c5a5bae990e668103955c165922ac5beda8ea76cd9d86c5
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Total Usage:
 0.0/4.0 CPU
 0B/32.28GiB memory
 0B/13.83GiB object_store_memory

From request_resources:
 (none)
Pending Demands:
 (no resource demands)
"""


def test_count_ray_nodes_real_output() -> None:
    assert count_ray_nodes(RAY_STATUS_2_60) == 2
    one = "\n".join(line for line in RAY_STATUS_2_60.splitlines() if "node_7b9d" not in line)
    assert count_ray_nodes(one) == 1


def test_count_ray_nodes() -> None:
    assert count_ray_nodes(RAY_STATUS) == 2
    assert count_ray_nodes(RAY_STATUS.replace(" 1 node_9d8e7f6a\n", "")) == 1
    assert count_ray_nodes("") == 0
