"""Launch plans, argv by argv, for every engine kind x single/mp/ray x rank."""

from __future__ import annotations

import re

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.engines import LaunchPlan, build_plan, count_ray_nodes, env_overrides, health_checked
from llmgw.agent.engines.env import VLLM_PORT_DP_SAFE, release
from llmgw.agent.engines.ray import RAY_MAX_GPUS, without_client_server_port
from llmgw.agent.engines.weights import weights_for
from llmgw.agent.process.spawn import default_plan
from llmgw.config.agent import (
    AgentConfig,
    EnginesConfig,
    KeysConfig,
    ModelDirConfig,
    SglangConfig,
    VllmConfig,
)
from llmgw.errors import ConfigError, EngineError
from llmgw.model.deployment import RAY_PORT_BLOCK
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec
from llmgw.model.inventory import EngineAvailability, Inventory, ModelCopy, StorageReport

GPUS = ("GPU-aaaa", "GPU-bbbb")
# NVML numbers the node's GPUs in PCI bus order, which is not the UUIDs' order.
IDX = {"GPU-aaaa": 3, "GPU-bbbb": 1, "GPU-cccc": 0, "GPU-dddd": 2}
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


BARE_ENV = {
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    "CUDA_VISIBLE_DEVICES": "3,1",
    "LLMGW_GPU_UUIDS": "GPU-aaaa,GPU-bbbb",
}
SINGLE_ENV = {**BARE_ENV, "NCCL_SOCKET_IFNAME": "=eno1", "GLOO_SOCKET_IFNAME": "eno1"}
MULTI_ENV = {
    **SINGLE_ENV,
    "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
    "VLLM_HOST_IP": "10.0.0.2",
}
SERVE = ("--host", "10.0.0.2", "--port", "20001", "--served-model-name", "llama")


def test_vllm_single_node() -> None:
    plan = build_plan(spec(), config(), WORK, gpu_indices=IDX)
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
    plan = build_plan(spec(rank=0), config("mp"), WORK, gpu_indices=IDX)
    assert plan.main.argv == (
        "/opt/vllm/bin/vllm", "serve", "org/llama", *SERVE, *MP_TAIL,
        "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29600",
        "--max-model-len", "8192",
    )  # fmt: skip
    assert plan.main.env == MULTI_ENV and plan.health_checked


def test_vllm_mp_rank1_headless() -> None:
    plan = build_plan(spec(rank=1), config("mp"), WORK, gpu_indices=IDX)
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
        # 2 GPUs: --num-cpus=4, worker ports for 4 pooled workers + 2 GPU actors + 4 spare.
        "--min-worker-port=27016", "--max-worker-port=27025",
    )  # fmt: skip
    if head:
        ports += (
            "--ray-client-server-port=27006", "--dashboard-port=27007",
            "--include-dashboard=false",
        )  # fmt: skip
    return ports


def test_vllm_ray_head() -> None:
    plan = build_plan(spec(rank=0), config("ray"), WORK, gpu_indices=IDX)
    head, serve = plan.processes
    assert head.name == "ray-head" and serve.name == "engine"
    assert head.argv == (
        "/opt/vllm/bin/ray", "start", "--head", "--port=26379",
        "--node-ip-address=10.0.0.2", "--num-gpus=2", "--num-cpus=4", f"--temp-dir={CWD}/ray",
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
    plan = build_plan(spec(rank=1), config("ray"), WORK, gpu_indices=IDX)
    (worker,) = plan.processes
    assert worker.name == "ray-worker"
    assert worker.argv == (
        "/opt/vllm/bin/ray", "start", "--address=10.0.0.1:26379",
        "--node-ip-address=10.0.0.2", "--num-gpus=2", "--num-cpus=4", f"--temp-dir={CWD}/ray",
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
    plans = [
        build_plan(spec(rank=r, replica_id=long_id), config("ray"), WORK, gpu_indices=IDX) for r in (0, 1)
    ]
    dirs = [_temp_dir(p.processes[0].argv) for p in plans]
    assert dirs[0] == dirs[1]  # same work dir and replica: the same dir
    assert dirs[0].startswith("/tmp/llmgw-ray-") and len(dirs[0]) <= 40
    worst = f"{dirs[0]}/session_2026-12-02_11-56-18_263880_4194304/sockets/plasma_store.1"
    assert len(worst) <= 107
    other = build_plan(
        spec(rank=0, replica_id=long_id), config("ray"), "/srv/llmgw-agent-other", gpu_indices=IDX
    )
    assert _temp_dir(other.processes[0].argv) != dirs[0]
    # A short one stays in the engine's own folder.
    assert (
        _temp_dir(build_plan(spec(rank=0), config("ray"), WORK, gpu_indices=IDX).processes[0].argv)
        == f"{CWD}/ray"
    )


def test_vllm_ray_drain_timeout_deployment_wins() -> None:
    s = spec(rank=1)
    s = attrs.evolve(s, env={**s.env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "5"})
    (worker,) = build_plan(s, config("ray"), WORK, gpu_indices=IDX).processes
    assert worker.env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "5"


def test_without_client_server_port() -> None:
    head = build_plan(spec(rank=0), config("ray"), WORK, gpu_indices=IDX).processes[0].argv
    bare = without_client_server_port(head)
    assert "--ray-client-server-port=27006" in head
    assert bare == tuple(a for a in head if a != "--ray-client-server-port=27006")
    assert without_client_server_port(bare) == bare


def test_vllm_ray_needs_ports() -> None:
    s = spec(rank=0)
    assert s.gang is not None
    s = attrs.evolve(s, gang=attrs.evolve(s.gang, ray_port=0))
    with pytest.raises(EngineError, match="ray_port"):
        build_plan(s, config("ray"), WORK, gpu_indices=IDX)


def test_vllm_bad_launch_mode() -> None:
    with pytest.raises(ConfigError, match="launch_mode"):
        build_plan(spec(rank=0), config("slurm"), WORK, gpu_indices=IDX)
    # A single-node replica does not care.
    assert build_plan(spec(), config("slurm"), WORK, gpu_indices=IDX).main.argv[1] == "serve"


SG = (
    "/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "org/llama",
    "--served-model-name", "llama", "--host", "10.0.0.2", "--port", "20001",
)  # fmt: skip


def test_sglang_single_node() -> None:
    plan = build_plan(spec(EngineKind.SGLANG), config(), WORK, gpu_indices=IDX)
    assert plan.main.argv == (*SG, "--tp-size", "2", "--enable-metrics", "--max-model-len", "8192")
    assert plan.main.env == SINGLE_ENV and plan.health_checked


@pytest.mark.parametrize("rank", [0, 1])
def test_sglang_multi_node(rank: int) -> None:
    plan = build_plan(spec(EngineKind.SGLANG, rank=rank), config(), WORK, gpu_indices=IDX)
    # SGLang's --tp counts the whole replica: 2 GPUs per node x 2 nodes.
    assert plan.main.argv == (
        *SG, "--tp-size", "4", "--enable-metrics", "--nnodes", "2", "--node-rank", str(rank),
        "--dist-init-addr", "10.0.0.1:29600", "--max-model-len", "8192",
    )  # fmt: skip
    assert plan.main.env == MULTI_ENV
    assert plan.health_checked is (rank == 0)  # other ranks: a dummy health server


def test_simulated_single_and_mp() -> None:
    plan = build_plan(spec(EngineKind.SIMULATED), config(), WORK, python="/usr/bin/python3", gpu_indices=IDX)
    assert plan.main.argv == (
        "/usr/bin/python3", "-m", "llmgw.simengine", "serve", "org/llama", *SERVE,
        "--tensor-parallel-size", "2", "--max-model-len", "8192",
    )  # fmt: skip
    plan = build_plan(
        spec(EngineKind.SIMULATED, rank=1), config("mp", "/sim/py"), WORK, python="x", gpu_indices=IDX
    )
    assert plan.main.argv == (
        "/sim/py", "-m", "llmgw.simengine", "serve", "org/llama", *MP_TAIL,
        "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29600",
        "--headless", "--max-model-len", "8192",
    )  # fmt: skip


def test_simulated_gang_is_mp_shaped_even_where_vllm_uses_ray() -> None:
    # The simulated engine's gang rendezvous is mp-shaped; it never needs Ray installed.
    # (To run the real Ray plan without GPUs, point engines.vllm.bin at the simulator.)
    plan = build_plan(spec(EngineKind.SIMULATED, rank=0), config("ray"), WORK, python="py", gpu_indices=IDX)
    assert len(plan.processes) == 1
    assert plan.main.argv[:5] == ("py", "-m", "llmgw.simengine", "serve", "org/llama")
    assert "--master-port" in plan.main.argv
    argv = plan.main.argv
    assert argv[argv.index("--distributed-executor-backend") + 1] == "mp"


def test_simulated_needs_an_interpreter() -> None:
    with pytest.raises(ConfigError, match="simulated_python"):
        build_plan(spec(EngineKind.SIMULATED), config(), WORK, gpu_indices=IDX)


def test_deployment_env_wins_and_is_reported() -> None:
    s = spec(rank=0, env={"NCCL_SOCKET_IFNAME": "bond0", "NCCL_DEBUG": "INFO"})
    plan = build_plan(s, config("mp"), WORK, gpu_indices=IDX)
    assert plan.main.env == {**MULTI_ENV, "NCCL_SOCKET_IFNAME": "bond0", "NCCL_DEBUG": "INFO"}
    assert plan.env_overrides == ("NCCL_SOCKET_IFNAME",)
    assert env_overrides(s, config("mp"), IDX) == ("NCCL_SOCKET_IFNAME",)
    # Same value: nothing was overridden.
    same = spec(env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert build_plan(same, config(), WORK, gpu_indices=IDX).env_overrides == ()


def test_ray_address_override_by_deployment() -> None:
    s = spec(rank=0, env={"RAY_ADDRESS": "10.9.9.9:1"})
    serve = build_plan(s, config("ray"), WORK, gpu_indices=IDX).main
    assert serve.env["RAY_ADDRESS"] == "10.9.9.9:1"


def test_no_interface_no_hcas() -> None:
    cfg = attrs.evolve(config("mp"), mgmt_interface="")
    s = spec(rank=0)
    assert s.gang is not None
    s = attrs.evolve(s, gang=attrs.evolve(s.gang, hcas=()))
    assert build_plan(s, cfg, WORK, gpu_indices=IDX).main.env == {**BARE_ENV, "VLLM_HOST_IP": "10.0.0.2"}


@pytest.mark.parametrize("replica", ["", "..", "a/b"])
def test_bad_replica_id(replica: str) -> None:
    with pytest.raises(EngineError):
        build_plan(spec(replica_id=replica), config(), WORK, gpu_indices=IDX)


def test_rank_outside_gang() -> None:
    s = spec(rank=0)
    assert s.gang is not None
    with pytest.raises(EngineError, match="rank 2"):
        build_plan(attrs.evolve(s, gang=attrs.evolve(s.gang, rank=2)), config(), WORK, gpu_indices=IDX)


def test_plans_are_pure_and_frozen() -> None:
    a = build_plan(spec(rank=0), config("ray"), WORK, gpu_indices=IDX)
    assert a == build_plan(spec(rank=0), config("ray"), WORK, gpu_indices=IDX)
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


# A worker that has joined but runs nothing yet: Ray's autoscaler lists it under "Idle:".
RAY_STATUS_IDLE = RAY_STATUS_2_60.replace(
    "Active:\n 1 node_06ad0cf8a6142ce7861fc46783ef11dbc4850436b197033f16a45690\n",
    "Active:\n 1 node_06ad0cf8a6142ce7861fc46783ef11dbc4850436b197033f16a45690\nIdle:\n",
).replace("Pending:\n (no pending nodes)", "Pending:\n 1 node_pending0000")


def test_count_ray_nodes_counts_idle_nodes_not_pending_ones() -> None:
    assert "Idle:\n 1 node_7b9d" in RAY_STATUS_IDLE
    assert count_ray_nodes(RAY_STATUS_IDLE) == 2
    all_idle = RAY_STATUS_2_60.replace("Active:\n", "Active:\n (no active nodes)\nIdle:\n")
    assert count_ray_nodes(all_idle) == 2


def test_count_ray_nodes() -> None:
    assert count_ray_nodes(RAY_STATUS) == 2
    assert count_ray_nodes(RAY_STATUS.replace(" 1 node_9d8e7f6a\n", "")) == 1
    assert count_ray_nodes("") == 0


# ---------------------------------------------------------------- issue 18: what the engine is handed

DIGITS = re.compile(r"^\d+(,\d+)*$")


SHAPES = (
    ("vllm-single", EngineKind.VLLM, None, "mp"),
    ("vllm-mp-0", EngineKind.VLLM, 0, "mp"),
    ("vllm-mp-1", EngineKind.VLLM, 1, "mp"),
    ("vllm-ray-head", EngineKind.VLLM, 0, "ray"),
    ("vllm-ray-worker", EngineKind.VLLM, 1, "ray"),
    ("sglang-single", EngineKind.SGLANG, None, "mp"),
    ("sglang-0", EngineKind.SGLANG, 0, "mp"),
    ("sglang-1", EngineKind.SGLANG, 1, "mp"),
    ("simulated-single", EngineKind.SIMULATED, None, "mp"),
    ("simulated-mp-1", EngineKind.SIMULATED, 1, "mp"),
)


def _every_plan(**kw: object) -> dict[str, LaunchPlan]:
    """One plan of every shape: vLLM single/mp/ray x rank, SGLang, simulated."""
    return {
        name: build_plan(spec(kind, rank=rank, **kw), config(mode), WORK, python="py", gpu_indices=IDX)
        for name, kind, rank, mode in SHAPES
    }


def test_every_process_of_every_plan_gets_nvml_indices_never_uuids() -> None:
    plans = _every_plan()
    for name, plan in plans.items():
        for p in plan.processes:
            cvd = p.env["CUDA_VISIBLE_DEVICES"]
            assert DIGITS.match(cvd), (name, p.name, cvd)
            # In the spec's order (GPU-aaaa is NVML 3, GPU-bbbb is 1), not sorted.
            assert cvd == "3,1", (name, p.name)
            assert p.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            # The UUIDs stay visible, for the log, in the same order.
            assert p.env["LLMGW_GPU_UUIDS"] == "GPU-aaaa,GPU-bbbb"
        assert plan.gpus == (("GPU-aaaa", 3), ("GPU-bbbb", 1)), name
    assert len(plans["vllm-ray-head"].processes) == 2  # both the Ray head and vllm serve


def test_indices_follow_the_spec_order() -> None:
    s = spec(gpus=("GPU-dddd", "GPU-cccc", "GPU-aaaa", "GPU-bbbb"), tensor_parallel=4)
    assert build_plan(s, config(), WORK, gpu_indices=IDX).main.env["CUDA_VISIBLE_DEVICES"] == "2,0,3,1"


def test_eight_gpus_fit_vllm_p2p_cache_file_name() -> None:
    # vLLM names its P2P cache gpu_p2p_access_cache_for_<CUDA_VISIBLE_DEVICES>.json: eight
    # UUIDs made that name longer than a file name may be (255 bytes).
    uuids = tuple(f"GPU-{i:08x}-1111-2222-3333-444455556666" for i in range(8))
    s = spec(gpus=uuids, tensor_parallel=8)
    cvd = build_plan(s, config(), WORK, gpu_indices={u: 7 - i for i, u in enumerate(uuids)}).main.env[
        "CUDA_VISIBLE_DEVICES"
    ]
    assert cvd == "7,6,5,4,3,2,1,0"
    assert len(f"gpu_p2p_access_cache_for_{cvd}.json") < 255


def test_a_placed_gpu_missing_on_the_node_refuses_the_plan() -> None:
    with pytest.raises(EngineError, match=r"^GPU GPU-bbbb is not on this node now: .*GPU-aaaa"):
        build_plan(spec(), config(), WORK, gpu_indices={"GPU-aaaa": 0})
    with pytest.raises(EngineError, match="NVML lists none"):
        build_plan(spec(rank=1), config("ray"), WORK, gpu_indices={})


@pytest.mark.parametrize("bad", [-1, True, "1", None])
def test_an_unusable_index_refuses_the_plan(bad: object) -> None:
    with pytest.raises(EngineError):
        build_plan(spec(), config(), WORK, gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": bad})


def test_two_gpus_with_one_index_refuse_the_plan() -> None:
    with pytest.raises(EngineError, match="NVML index 1"):
        build_plan(spec(), config(), WORK, gpu_indices={"GPU-aaaa": 1, "GPU-bbbb": 1})


def test_an_engine_without_gpus_sees_none() -> None:
    # "" hides every GPU from CUDA; unset would show the engine all of the node's.
    plan = build_plan(spec(EngineKind.SIMULATED, gpus=()), config(), WORK, python="py", gpu_indices={})
    assert plan.main.env["CUDA_VISIBLE_DEVICES"] == "" and plan.main.env["LLMGW_GPU_UUIDS"] == ""
    assert plan.gpus == ()


@given(
    placed=st.lists(st.sampled_from([f"GPU-{c}" for c in "abcdefgh"]), max_size=8, unique=True),
    node=st.dictionaries(st.sampled_from([f"GPU-{c}" for c in "abcdefgh"]), st.integers(-2, 16)),
)
def test_numbering_is_integers_or_a_typed_refusal(placed: list[str], node: dict[str, int]) -> None:
    s = spec(gpus=tuple(placed))
    try:
        plan = build_plan(s, config(), WORK, gpu_indices=node)
    except EngineError:
        return
    cvd = plan.main.env["CUDA_VISIBLE_DEVICES"]
    assert cvd == "" if not placed else DIGITS.match(cvd)
    assert [int(x) for x in cvd.split(",") if x] == [node[u] for u in placed]


def test_bootstrap_interface_on_one_node_too() -> None:
    # Single node, tensor parallel 2: torch's Gloo group binds the hostname's address
    # (127.0.1.1 on Debian/Ubuntu) unless told; NCCL's "=" makes eno1 not match eno10.
    for name, plan in _every_plan().items():
        for p in plan.processes:
            assert p.env["NCCL_SOCKET_IFNAME"] == "=eno1", (name, p.name)
            assert p.env["GLOO_SOCKET_IFNAME"] == "eno1", (name, p.name)  # Gloo: exact names, no "="
    bare = attrs.evolve(config(), mgmt_interface="")
    env = build_plan(spec(), bare, WORK, gpu_indices=IDX).main.env
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in env


def test_vllm_port_from_the_engine_block() -> None:
    plans = _every_plan(port_base=20100)
    for name in ("vllm-single", "vllm-mp-0", "vllm-mp-1", "vllm-ray-head", "vllm-ray-worker"):
        for p in plans[name].processes:  # Ray's processes too: its workers inherit it
            assert p.env["VLLM_PORT"] == "20100", (name, p.name)
    for name in ("sglang-single", "sglang-0", "simulated-single", "simulated-mp-1"):
        assert "VLLM_PORT" not in plans[name].main.env, name
    # A spec from a server before the block: vLLM picks its own, as it did then.
    for name, plan in _every_plan().items():
        assert all("VLLM_PORT" not in p.env for p in plan.processes), name


def test_no_vllm_port_for_data_parallelism_on_a_vllm_that_hangs_with_it() -> None:
    """vLLM before 0.28 could hang at start with VLLM_PORT and --data-parallel-size > 1
    (vllm#36191, #50024): there the engine picks its own ports; an unknown version counts
    as one of those. Without data parallelism, or from 0.28 on, the block's port stays."""
    def port(args: tuple[str, ...], version: str) -> str | None:
        plan = build_plan(spec(port_base=20100, args=args), config(), WORK, gpu_indices=IDX,
                          engine_version=version)
        return plan.main.env.get("VLLM_PORT")

    for dp in (("--data-parallel-size", "2"), ("-dp", "4"), ("--data-parallel-size=2",),
               ("--data_parallel_size", "2")):
        assert port(dp, "0.26.0") is None, dp
        assert port(dp, "0.27.1") is None, dp
        assert port(dp, "") is None, dp  # the agent could not read the version
        assert port(dp, "0.28.0") == "20100", dp
        assert port(dp, "0.32.0+cpu") == "20100", dp
    for single in ((), ("--data-parallel-size", "1"), ("--tensor-parallel-size", "2")):
        assert port(single, "0.26.0") == "20100", single
        assert port(single, "") == "20100", single


def test_the_agent_plans_with_the_vllm_version_its_engine_check_read() -> None:
    def plan(version: str) -> LaunchPlan:
        inv = Inventory(engines=(EngineAvailability("sglang", True, version="0.5.0"),
                                 EngineAvailability("vllm", True, version=version)))
        make = default_plan(config(), "/usr/bin/python3", inventory=lambda: inv)
        return make(spec(port_base=20100, args=("-dp", "2")), IDX)

    assert "VLLM_PORT" not in plan("0.26.0").main.env
    assert plan("0.32.0").main.env["VLLM_PORT"] == "20100"


def test_engine_versions_as_numbers() -> None:
    assert release("0.32.0+cpu") == (0, 32, 0)
    assert release("0.28.0rc1") == (0, 28, 0)
    assert release("0.9.2") == (0, 9, 2) and release("0.9.2") < VLLM_PORT_DP_SAFE
    assert release("") == () and release("dev") == ()


def test_vllm_port_deployment_wins_and_is_reported() -> None:
    plan = build_plan(spec(port_base=20100, env={"VLLM_PORT": "40000"}), config(), WORK, gpu_indices=IDX)
    assert plan.main.env["VLLM_PORT"] == "40000" and plan.env_overrides == ("VLLM_PORT",)


def test_sglang_ports_from_the_engine_block() -> None:
    one = build_plan(spec(EngineKind.SGLANG, port_base=20100), config(), WORK, gpu_indices=IDX).main.argv
    assert one == (
        *SG, "--tp-size", "2", "--enable-metrics", "--nccl-port", "20100", "--dist-init-addr", "10.0.0.2:20101",
        "--max-model-len", "8192",
    )  # fmt: skip
    for rank in (0, 1):
        s = spec(EngineKind.SGLANG, rank=rank, port_base=20200)
        argv = build_plan(s, config(), WORK, gpu_indices=IDX).main.argv
        assert argv == (
            *SG, "--tp-size", "4", "--enable-metrics", "--nccl-port", "20200", "--nnodes", "2", "--node-rank", str(rank),
            "--dist-init-addr", "10.0.0.1:29600", "--max-model-len", "8192",
        )  # fmt: skip


def test_ray_num_cpus_and_worker_ports_follow_the_gpus() -> None:
    uuids = tuple(f"GPU-{c}" for c in "abcdefgh")
    s = spec(rank=1, gpus=uuids, tensor_parallel=8)
    (worker,) = build_plan(s, config("ray"), WORK, gpu_indices={u: i for i, u in enumerate(uuids)}).processes
    flags = dict(a.split("=", 1) for a in worker.argv if a.startswith("--") and "=" in a)
    assert flags["--num-gpus"] == "8" and flags["--num-cpus"] == "10"
    lo, hi = int(flags["--min-worker-port"]), int(flags["--max-worker-port"])
    # One port per pooled worker (num_cpus) and per GPU actor, and spare ones; inside the block.
    assert hi - lo + 1 == 10 + 8 + 4
    assert 27000 <= lo <= hi < 27000 + RAY_PORT_BLOCK


def test_ray_member_with_more_gpus_than_its_block_has_ports_for() -> None:
    uuids = tuple(f"GPU-{i}" for i in range(RAY_MAX_GPUS + 1))
    s = spec(rank=0, gpus=uuids, tensor_parallel=len(uuids))
    with pytest.raises(EngineError, match="worker ports"):
        build_plan(s, config("ray"), WORK, gpu_indices={u: i for i, u in enumerate(uuids)})
    ok = spec(rank=0, gpus=uuids[:-1], tensor_parallel=RAY_MAX_GPUS)
    build_plan(ok, config("ray"), WORK, gpu_indices={u: i for i, u in enumerate(uuids)})


def test_health_checked_without_a_plan() -> None:
    plans = _every_plan()
    for name, kind, rank, _ in SHAPES:
        assert health_checked(spec(kind, rank=rank)) is plans[name].health_checked, name


def test_default_plan_takes_the_node_numbering() -> None:
    cfg = attrs.evolve(config(), supervisor=attrs.evolve(config().supervisor, work_dir=WORK))
    plan_fn = default_plan(cfg, "py")
    assert plan_fn(spec(), IDX).main.env["CUDA_VISIBLE_DEVICES"] == "3,1"
    with pytest.raises(EngineError, match="not on this node now"):
        plan_fn(spec(), {})


# ---- weights (issue 23): a node's copy by path, or a download into download_dir ----

SNAPSHOT = "/hub/models--org--llama/snapshots/rev1"
NODES = {
    # node -> (its storage scan, the model argument, the env llmgw adds, vLLM's extra args)
    "plain": (StorageReport(True, (ModelCopy("org/llama", "/data/models/org/llama", 9, True),)),
              "/data/models/org/llama", {}, ()),
    "hf-cache": (StorageReport(True, (ModelCopy("org/llama", SNAPSHOT, 9, True, shared=True,
                                                store="weka-a"),)),
                 SNAPSHOT, {"HF_HUB_CACHE": "/hub", "HF_HUB_OFFLINE": "1"}, ()),
    "nothing": (StorageReport(True, ()), "org/llama", {"HF_HUB_CACHE": "/data/models"},
                ("--download-dir", "/data/models")),
}


def _weights_config(mode: str = "mp") -> AgentConfig:
    return attrs.evolve(config(mode), model_dirs=(ModelDirConfig("/data/models"),))


@pytest.mark.parametrize("node", sorted(NODES))
def test_vllm_weights_per_node(node: str) -> None:
    storage, model, env, extra = NODES[node]
    cfg = _weights_config()
    w = weights_for(spec(), cfg, storage)
    plan = build_plan(spec(), cfg, WORK, gpu_indices=IDX, weights=w)
    assert plan.main.argv == (
        "/opt/vllm/bin/vllm", "serve", model, *SERVE,
        "--tensor-parallel-size", "2", *extra, "--max-model-len", "8192",
    )  # fmt: skip
    assert plan.main.env == {**SINGLE_ENV, **env}
    # The served name is the deployment's, whatever the engine loads.
    assert plan.main.argv[plan.main.argv.index("--served-model-name") + 1] == "llama"


@pytest.mark.parametrize("node", sorted(NODES))
def test_sglang_weights_per_node(node: str) -> None:
    storage, model, env, extra = NODES[node]
    cfg = _weights_config()
    s = spec(EngineKind.SGLANG)
    plan = build_plan(s, cfg, WORK, gpu_indices=IDX, weights=weights_for(s, cfg, storage))
    argv = plan.main.argv
    assert argv[argv.index("--model-path") + 1] == model
    assert argv[argv.index("--served-model-name") + 1] == "llama"
    # SGLang 0.5.23 takes --download-dir as vLLM does (its parser: the real-engine tier).
    assert (argv[-4:-2] == extra) if extra else "--download-dir" not in argv
    assert plan.main.env == {**SINGLE_ENV, **env}


@pytest.mark.parametrize("node", sorted(NODES))
def test_vllm_mp_members_each_load_their_own_copy(node: str) -> None:
    storage, model, env, extra = NODES[node]
    cfg = _weights_config("mp")
    for rank in (0, 1):
        s = spec(rank=rank)
        plan = build_plan(s, cfg, WORK, gpu_indices=IDX, weights=weights_for(s, cfg, storage))
        assert plan.main.argv[2] == model and plan.main.env == {**MULTI_ENV, **env}
        assert (plan.main.argv[-4:-2] == extra) if extra else "--download-dir" not in plan.main.argv


def test_ray_gang_head_keeps_the_id_for_a_local_copy() -> None:
    storage = NODES["plain"][0]
    cfg = _weights_config("ray")
    s = spec(rank=0)
    plan = build_plan(s, cfg, WORK, gpu_indices=IDX, weights=weights_for(s, cfg, storage))
    assert plan.main.argv[2] == "org/llama"  # workers on other nodes would lack the path
    hf = NODES["hf-cache"][0]  # a shared copy: every member sees it
    plan = build_plan(s, cfg, WORK, gpu_indices=IDX, weights=weights_for(s, cfg, hf))
    assert plan.main.argv[2] == SNAPSHOT


def test_deployment_env_and_args_win_over_weights() -> None:
    cfg = _weights_config()
    s = spec(env={"HF_HUB_OFFLINE": "0"}, args=("--download-dir", "/mine"))
    hf = build_plan(s, cfg, WORK, gpu_indices=IDX, weights=weights_for(s, cfg, NODES["hf-cache"][0]))
    assert hf.main.env["HF_HUB_OFFLINE"] == "0" and hf.env_overrides == ("HF_HUB_OFFLINE",)
    dl = build_plan(s, cfg, WORK, gpu_indices=IDX, weights=weights_for(s, cfg, NODES["nothing"][0]))
    argv = dl.main.argv
    # argparse keeps the last: the deployment's own folder.
    assert argv[-4:] == ("--download-dir", "/data/models", "--download-dir", "/mine")


def test_simulated_engine_gets_the_path_but_no_download_flag() -> None:
    cfg = _weights_config()
    s = spec(EngineKind.SIMULATED)
    for node in NODES:
        storage, model, env, _ = NODES[node]
        plan = build_plan(s, cfg, WORK, python="py", gpu_indices=IDX,
                          weights=weights_for(s, cfg, storage))
        assert plan.main.argv[4] == model and "--download-dir" not in plan.main.argv
        assert plan.main.argv[plan.main.argv.index("--served-model-name") + 1] == "llama"


def test_no_weights_is_the_model_as_written() -> None:
    cfg = _weights_config()
    assert build_plan(spec(), cfg, WORK, gpu_indices=IDX) == build_plan(spec(), config(), WORK, gpu_indices=IDX)


def test_default_plan_reads_the_storage_getter_at_each_plan() -> None:
    cfg = attrs.evolve(_weights_config(), supervisor=attrs.evolve(config().supervisor, work_dir=WORK))
    scans = [NODES["nothing"][0]]
    plan_fn = default_plan(cfg, "py", lambda: scans[-1])
    assert plan_fn(spec(), IDX).main.argv[2] == "org/llama"
    scans.append(NODES["plain"][0])  # the download finished: the next scan holds it
    assert plan_fn(spec(), IDX).main.argv[2] == "/data/models/org/llama"
    assert default_plan(cfg, "py")(spec(), IDX).main.argv[2] == "org/llama"
