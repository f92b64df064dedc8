"""Every vLLM launch plan llmgw builds is accepted by the installed vLLM's own `vllm serve`
argument parser (and its validation), flag by exact flag: a flag renamed in a vLLM release
fails here, not in a production rollout. And vLLM's own device-numbering code reads every
plan's CUDA_VISIBLE_DEVICES as the GPUs that were placed."""

from __future__ import annotations

import json
import random
import socket
import subprocess
from pathlib import Path

import attrs
import pytest

from llmgw.agent.engines import LaunchPlan, build_plan
from llmgw.agent.engines.weights import Weights
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, VllmConfig
from llmgw.model.deployment import ENGINE_PORT_BLOCK
from llmgw.model.engine import Adapter, EngineKind, EngineSpec, GangSpec

pytestmark = pytest.mark.real_engine
HERE = Path(__file__).resolve().parent
VLLM = "/opt/vllm/bin/vllm"


def _config(mode: str) -> AgentConfig:
    return AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                       mgmt_addr="10.0.0.2", mgmt_interface="eno1",
                       engines=EnginesConfig(vllm=VllmConfig(bin=VLLM, launch_mode=mode,
                                                             ray_bin="/opt/vllm/bin/ray")))


def _spec(rank: int | None) -> EngineSpec:
    gang = None if rank is None else GangSpec(2, rank, "10.0.0.1", 29600, ("mlx5_0",),
                                              ray_port=26379, ray_port_base=27000)
    return EngineSpec("r1", 3, "llama", "/models/llama", "llama", EngineKind.VLLM,
                      ("GPU-aaaa", "GPU-bbbb"), 20001, tensor_parallel=2,
                      args=("--max-model-len", "512", "--enforce-eager"), gang=gang)


def _plans() -> dict[str, tuple[str, ...]]:
    out = {}
    for name, mode, rank in (("single", "mp", None), ("mp-rank0", "mp", 0),
                             ("mp-rank1-headless", "mp", 1), ("ray-head", "ray", 0)):
        plan = build_plan(_spec(rank), _config(mode), "/var/lib/llmgw-agent",
                          gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": 1})
        argv = plan.main.argv
        assert argv[0] == VLLM and argv[1] == "serve", argv
        out[name] = argv[1:]
    out["single-lora"] = _lora_plan().main.argv[1:]
    out["single-lora-shared"] = _lora_plan(3).main.argv[1:]
    out["single-download"] = _download_plan().main.argv[1:]
    out["single-sleep"] = _sleep_plan(None).main.argv[1:]
    out["mp-rank1-sleep"] = _sleep_plan(1).main.argv[1:]
    out["single-priority"] = _priority_plan().main.argv[1:]
    return out


def _priority_plan() -> LaunchPlan:
    """Priority classes on the engine: the deployment's args carry the scheduling policy."""
    spec = _spec(None)
    return build_plan(attrs.evolve(spec, args=(*spec.args, "--scheduling-policy", "priority")),
                      _config("mp"), "/var/lib/llmgw-agent", gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": 1})


def _sleep_plan(rank: int | None) -> LaunchPlan:
    return build_plan(attrs.evolve(_spec(rank), sleep_mode=True), _config("mp"),
                      "/var/lib/llmgw-agent", gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": 1})


def _download_plan() -> LaunchPlan:
    """A node with no copy: vLLM fetches the hub id into the agent's download_dir."""
    weights = Weights("org/llama", {"HF_HUB_CACHE": "/data/hf/hub"}, None, "downloading",
                      download_dir="/data/hf/hub")
    return build_plan(attrs.evolve(_spec(None), model="org/llama"), _config("mp"),
                      "/var/lib/llmgw-agent", gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": 1},
                      weights=weights)


def _lora_plan(n: int = 1) -> LaunchPlan:
    """`n` adapters on 2 slots: above 2 they share them (--max-cpu-loras n)."""
    more = tuple(Adapter(f"llama-{i}", f"/models/a{i}") for i in range(1, n))
    spec = attrs.evolve(_spec(None), adapters=(Adapter("llama-sql", "/models/sql"), *more),
                        max_loras=2, max_lora_rank=32)
    return build_plan(spec, _config("mp"), "/var/lib/llmgw-agent",
                      gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": 1})


def _parse(venv: Path, argvs: list[list[str]]) -> list[dict]:
    r = subprocess.run([str(venv / "bin" / "python"), str(HERE / "vllm_args_check.py")],
                       input=json.dumps(argvs), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)  # type: ignore[no-any-return]


RENAMED = "--served-model"  # --served-model-name, as a release might rename it
PROBES = {"unknown flag": ["serve", "m", "--nnodez", "2"],
          "prefix of a flag": ["serve", "m", "--nnode", "2"],
          "renamed flag": ["serve", "m", RENAMED, "x"]}


@pytest.fixture(scope="module")
def parsed(vllm_venv: Path) -> dict[str, dict]:
    """All argv lists through one vLLM import (it takes tens of seconds on 2 cores)."""
    plans = _plans()
    argvs = [list(a) for a in plans.values()] + list(PROBES.values())
    return dict(zip([*plans, *PROBES], _parse(vllm_venv, argvs), strict=True))


def test_every_vllm_plan_parses_with_the_installed_vllm(parsed: dict[str, dict]) -> None:
    plans = _plans()
    for name in plans:
        assert parsed[name]["ok"], f"{name}: {' '.join(plans[name])}\n{parsed[name]['error']}"
    single = parsed["single"]["args"]
    assert (single["model_tag"], single["host"], single["port"]) == ("/models/llama", "10.0.0.2", 20001)
    assert single["served_model_name"] == ["llama"] and single["tensor_parallel_size"] == 2
    assert single["max_model_len"] == 512 and single["enforce_eager"] is True
    head, member = parsed["mp-rank0"]["args"], parsed["mp-rank1-headless"]["args"]
    for a, rank in ((head, 0), (member, 1)):
        assert (a["nnodes"], a["node_rank"], a["pipeline_parallel_size"]) == (2, rank, 2)
        assert (a["master_addr"], a["master_port"]) == ("10.0.0.1", 29600)
        assert a["distributed_executor_backend"] == "mp"
    assert head["headless"] is False and member["headless"] is True
    ray = parsed["ray-head"]["args"]
    assert ray["distributed_executor_backend"] == "ray" and ray["pipeline_parallel_size"] == 2
    lora = parsed["single-lora"]["args"]
    assert (lora["enable_lora"], lora["max_loras"], lora["max_lora_rank"]) == (True, 2, 32)
    assert lora["max_cpu_loras"] is None  # vLLM's default: max_loras
    shared = parsed["single-lora-shared"]["args"]
    assert (shared["max_loras"], shared["max_cpu_loras"]) == (2, 3)  # and LoRAConfig takes it
    assert single["enable_lora"] is None  # no adapters: LoRA stays off
    # autoscale.sleep_when_idle: sleep mode on every rank (the workers hold the memory).
    assert parsed["single-sleep"]["args"]["enable_sleep_mode"] is True
    assert parsed["mp-rank1-sleep"]["args"]["enable_sleep_mode"] is True
    assert single["enable_sleep_mode"] is False
    fetch = parsed["single-download"]["args"]
    assert (fetch["model_tag"], fetch["download_dir"]) == ("org/llama", "/data/hf/hub")
    assert single["download_dir"] is None
    assert parsed["single-priority"]["args"]["scheduling_policy"] == "priority"
    assert single["scheduling_policy"] == "fcfs"  # vLLM's default: the field is ignored


def test_vllm_serves_the_sleep_endpoints_under_the_sleep_plans_env(vllm_venv: Path) -> None:
    """vLLM's envs.py reads the plan's environment as dev mode, without which
    serve/dev/sleep (POST /sleep, /wake_up, GET /is_sleeping) is never mounted."""
    env = {k: v for k, v in _sleep_plan(None).main.env.items() if k.startswith("VLLM_")}
    code = "import vllm.envs as e; print(e.VLLM_SERVER_DEV_MODE)"
    r = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", code], env={"PATH": "/usr/bin:/bin", **env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "True"


def test_vllm_reads_the_lora_plans_runtime_updating_switch(vllm_venv: Path) -> None:
    """vLLM's own envs.py reads the plan's environment as runtime LoRA updating allowed:
    without it /v1/load_lora_adapter is never mounted (serve/lora/api_router.py)."""
    env = {k: v for k, v in _lora_plan().main.env.items() if k.startswith("VLLM_")}
    assert env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    code = "import vllm.envs as e; print(e.VLLM_ALLOW_RUNTIME_LORA_UPDATING)"
    r = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", code], env={"PATH": "/usr/bin:/bin", **env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "True"


def test_the_check_refuses_unknown_renamed_and_abbreviated_flags(parsed: dict[str, dict]) -> None:
    for name in PROBES:
        assert not parsed[name]["ok"], name
    assert RENAMED in parsed["renamed flag"]["error"]
    assert "--nnode" in parsed["prefix of a flag"]["error"]


def test_headless_member_carries_the_deployment_args_last() -> None:
    argv = _plans()["mp-rank1-headless"]
    assert argv[-2:] == ("512", "--enforce-eager") and "--headless" in argv
    assert "--host" not in argv  # headless members serve no API


# A TP=4 replica whose UUIDs, in the order placement lists them, are NVML's 2, 0, 3, 1.
TP4 = ("GPU-11111111-0000-0000-0000-000000000000", "GPU-22222222-0000-0000-0000-000000000000",
       "GPU-33333333-0000-0000-0000-000000000000", "GPU-44444444-0000-0000-0000-000000000000")
NVML = {TP4[0]: 2, TP4[1]: 0, TP4[2]: 3, TP4[3]: 1}


def _device_envs() -> dict[str, dict[str, str]]:
    """The environment of every process of every vLLM plan shape for the TP=4 replica."""
    out = {}
    for name, mode, rank in (("single", "mp", None), ("mp-rank0", "mp", 0), ("mp-rank1", "mp", 1),
                             ("ray-head", "ray", 0), ("ray-worker", "ray", 1)):
        s = attrs.evolve(_spec(rank), gpus=TP4, tensor_parallel=4)
        plan = build_plan(s, _config(mode), "/var/lib/llmgw-agent", gpu_indices=NVML)
        for p in plan.processes:
            out[f"{name}/{p.name}"] = p.env
    return out


def _devices(venv: Path, envs: list[dict[str, str]]) -> dict:
    r = subprocess.run([str(venv / "bin" / "python"), str(HERE / "vllm_args_check.py"), "devices"],
                       input=json.dumps(envs), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_vllm_reads_every_plans_devices_as_the_placed_gpus(vllm_venv: Path) -> None:
    envs = _device_envs()
    assert len(envs) == 6  # the Ray head's plan is two processes
    old = {"CUDA_VISIBLE_DEVICES": ",".join(TP4)}  # what llmgw gave engines before issue 18
    got = _devices(vllm_venv, [*envs.values(), old])
    # vLLM's CUDA platform numbers devices by CUDA_VISIBLE_DEVICES, and none of its CUDA
    # classes overrides the mapping methods the check runs: they are what runs on a GPU.
    assert got["device_control_env_var"] == "CUDA_VISIBLE_DEVICES"
    mapping = {"device_id_to_physical_device_id", "visible_device_id_to_physical_device_id",
               "logical_device_id_to_visible_device_id"}
    assert set(got["cuda_methods"]) == {"CudaPlatformBase", "NvmlCudaPlatform", "NonNvmlCudaPlatform"}
    assert not [(c, m) for c, ms in got["cuda_methods"].items() for m in ms if m in mapping]
    *results, before = got["results"]
    for name, res in zip(envs, results, strict=True):
        assert res["ok"], (name, res)
        # Local rank r runs on the r-th placed GPU: NVML's 2, 0, 3, 1, not 0..3 or UUID order.
        assert res["physical"] == [2, 0, 3, 1], name
        assert res["visible_to_physical"] == [2, 0, 3, 1], name
        assert res["logical_to_visible"] == [0, 1, 2, 3], name
    # UUIDs: vLLM's integer parse refuses them (its NVML-backed CUDA platform looks them up
    # instead, but its P2P cache file name and older vLLMs take the value as integers).
    assert not before["ok"] and "Non-integer device ID" in before["error"]


def _free_block(size: int) -> int:
    """The first of `size` ports free on this host (bindable now). Above Linux's ephemeral
    range (32768-60999): a machine that has just made thousands of connections holds
    ports there in TIME_WAIT, and 16 in a row are then hard to find."""
    for _ in range(200):
        base = random.randrange(61000, 65536 - size)
        socks = []
        try:
            for port in range(base, base + size):
                sock = socket.socket()
                sock.bind(("", port))
                socks.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError(f"no {size} free ports in a row")


def test_vllm_takes_its_internal_ports_from_the_engine_block(vllm_venv: Path) -> None:
    base = _free_block(ENGINE_PORT_BLOCK)
    s = attrs.evolve(_spec(None), port_base=base)
    env = build_plan(s, _config("mp"), "/var/lib/llmgw-agent", gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": 1}).main.env
    assert env["VLLM_PORT"] == str(base)
    r = subprocess.run(
        [str(vllm_venv / "bin" / "python"), str(HERE / "vllm_args_check.py"), "ports"],
        input=json.dumps([{"env": env, "hold": []}, {"env": env, "hold": [base, base + 1]}]),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    free, busy = json.loads(r.stdout)
    block = range(base, base + ENGINE_PORT_BLOCK)
    # vLLM starts at VLLM_PORT and walks up to the next free port: inside the block.
    assert free["open_port"] == base and set(free["open_ports"]) <= set(block)
    assert busy["open_port"] == base + 2 and set(busy["open_ports"]) <= set(block)


def _check(venv: Path, mode: str, argvs: list[list[str]]) -> list:
    r = subprocess.run([str(venv / "bin" / "python"), str(HERE / "vllm_args_check.py"), mode],
                       input=json.dumps(argvs), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_vllm_builds_llmgws_kv_events_config(vllm_venv: Path) -> None:
    """The events config of a one-node plan and a gang head's, through vLLM's own parser
    into its own KVEventsConfig: events on, the zmq publisher, loopback ports of the engine
    block (the PUB's is connected to, having no "*"), the replica id as topic."""
    argvs = []
    for rank in (None, 0):
        s = attrs.evolve(_spec(rank), port_base=30000, kv_events=True)
        argvs.append(list(build_plan(s, _config("mp"), "/var/lib/llmgw-agent",
                                     gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": 1}).main.argv[1:]))
    off = list(build_plan(attrs.evolve(_spec(None), port_base=30000), _config("mp"), "/var/lib/llmgw-agent",
                          gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": 1}).main.argv[1:])
    single, head, none = _check(vllm_venv, "kv_events", [*argvs, off])
    for cfg in (single, head):
        assert cfg["class"] == "KVEventsConfig"
        assert (cfg["enable_kv_cache_events"], cfg["publisher"], cfg["topic"]) == (True, "zmq", "r1")
        assert (cfg["endpoint"], cfg["replay_endpoint"]) == ("tcp://127.0.0.1:30013", "tcp://127.0.0.1:30014")
    assert none is None


def test_every_mp_rank_builds_the_same_lora_config(vllm_venv: Path) -> None:
    """A headless rank's workers take their lora_config from its own argv (run_headless):
    rank 0's and the headless rank's LoRA engine arguments, as vLLM parses them, are equal."""
    three = (Adapter("a", "/models/a"), Adapter("b", "/models/b"), Adapter("c", "/models/c"))
    argvs = []
    for rank in (0, 1):
        s = attrs.evolve(_spec(rank), adapters=three, max_loras=2, max_lora_rank=32)
        argvs.append(list(build_plan(s, _config("mp"), "/var/lib/llmgw-agent",
                                     gpu_indices={"GPU-aaaa": 0, "GPU-bbbb": 1}).main.argv[1:]))
    head, member = _check(vllm_venv, "lora", argvs)
    assert "--headless" in argvs[1] and "--headless" not in argvs[0]
    assert (head["enable_lora"], head["max_loras"], head["max_lora_rank"], head["max_cpu_loras"]) == (True, 2, 32, 3)
    assert head == member


def test_llmgws_api_server_count_is_vllms(vllm_venv: Path) -> None:
    """config/vllm_serve.py's count, which refuses runtime LoRA at apply, against the count
    vLLM's own ServeSubcommand.cmd settles on, for the unit tests' table of args."""
    from llmgw.config.vllm_serve import api_server_count
    from unit.test_vllm_serve import CASES

    argvs = [["serve", "/models/llama", *args] for args, _ in CASES]
    assert _check(vllm_venv, "api_servers", argvs) == [api_server_count(a) for a, _ in CASES]


def test_vllm_takes_a_requests_priority_and_serves_the_fair_queues_bands_in_order(vllm_venv: Path) -> None:
    """vLLM's own request models take `priority` as an int, default 0, on completions and
    chat; its PriorityRequestQueue pops lower values first, so the values the fair queue
    gives its bands (router/routing/fairqueue.py vllm_priority) come out highest band
    first, each band in arrival order, whatever order they arrived in."""
    from llmgw.router.routing.fairqueue import Band, FairQueue

    hi, mid, lo = Band("interactive", 10, 5.0), Band("standard", 5, 20.0), Band("batch", 0, 60.0)
    q: FairQueue[str] = FairQueue([lo, hi, mid], 10)
    arrivals = [("lo-1", lo), ("mid-1", mid), ("lo-2", lo), ("hi-1", hi), ("mid-2", mid), ("hi-2", hi)]
    requests = [[rid, q.vllm_priority(band), float(t)] for t, (rid, band) in enumerate(arrivals)]
    plan = _priority_plan().main.argv[1:]
    r = subprocess.run([str(vllm_venv / "bin" / "python"), str(HERE / "vllm_args_check.py"), "priority"],
                       input=json.dumps({"argv": list(plan), "requests": requests}),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["engine_scheduling_policy"] == "priority"  # the engine config the plan builds
    assert got["priority_pop_order"] == ["hi-1", "hi-2", "mid-1", "mid-2", "lo-1", "lo-2"]
    assert got["fcfs_pop_order"] == [rid for rid, _ in arrivals]  # fcfs: arrival only
    for kind in ("completion", "chat"):
        field = got[kind]
        assert (field["annotation"], field["default"]) == ("<class 'int'>", 0), kind
        values = field["values"]
        assert (values["absent"], values["-3"], values["7"]) == (0, -3, 7), kind
        assert values["'2'"] == 2, kind  # pydantic's lax mode: a numeric string is taken
        for bad in ("'high'", "1.5", "2**63"):  # refused: the engine answers 400
            assert str(values[bad]).startswith("error: ValidationError"), (kind, bad)
