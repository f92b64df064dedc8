"""The GPU check's live steps: llmgw's real processes (server, agent, router) with an
engine on the GPU, through llmgw's own launch plans.

- cluster: server, agent and router up; the node ready with its GPUs.
- serve: a chat completion through the router (plain HTTP); the engine's
  CUDA_VISIBLE_DEVICES NVML indices.
- foreign_memory: a process that is no engine of llmgw holds ~85% of every GPU; a
  deployment that would land there is refused, and the reason names that pid.
- kill_while_loading: an engine SIGKILLed while it loads; the seconds until its GPU
  memory is back (NVML) and until a replica is placed on that GPU again.
- startup_deadline: a stand-in that never serves and says nothing, and one that logs
  vLLM's "No available shared memory broadcast block" line every second (a deadlocked
  first forward): both must be failed at startup_timeout, not held for startup_max.
- sleep_wake: a deployment with sleep_when_idle, idle until asleep; NVML's used memory
  awake, asleep and woken again by a request through the router, the same pid.

Three sides stand behind the same steps (`Side`): `StandinSide`, the GPU machine with
torch but no vLLM: real NVML, the torch stand-in for vLLM (bench/gpu_check_vllm.py) as
`engines.vllm.bin`, a torch process as the foreign holder; `SimulatedSide`, the suite's:
the same stand-in in its fake-CUDA mode over the agent's NVML faked from a state file
(bench/gpu_check_fake_nvml/pynvml.py), in which the check lists a sleeping process as the
holder; `VllmSide`, real vLLM from a venv (where the package index is reachable).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from attrs import field, frozen
from gpu_check_steps import REPO, Deadline, Outcome

sys.path.insert(0, str(REPO / "tests"))

from fakes.live import LLMGW, Cluster, Proc, engine_pids  # noqa: E402
from llmgw.agent.process import procs  # noqa: E402

BENCH = Path(__file__).resolve().parent
FAKE_NVML_DIR = BENCH / "gpu_check_fake_nvml"
STANDIN = BENCH / "gpu_check_vllm.py"
NODE = "gpu-1"
POLL = 0.25
HOG_FRACTION = 0.85
UTILIZATION = 0.3  # the stand-in's and vLLM's share: the foreign process's 85% leaves less
CVD = re.compile(r"^\d+(,\d+)*$")
MODEL = "tiny"  # the served name of the serve step
STALL_TIMEOUT = 8  # startup_timeout of the stalling deployments, seconds
STALL_SLACK = 20.0  # what the agent may take past it (its checks, the kill, the report)


@frozen
class GpuNow:
    """One GPU as the check's own NVML read sees it (not llmgw's code: the measure
    must not be the thing measured)."""

    uuid: str
    index: int
    total: int  # MiB
    free: int  # MiB
    pids: dict[int, int]  # compute process -> MiB

    @property
    def used(self) -> int:
        return self.total - self.free


def read_gpus(nvml: Any) -> dict[str, GpuNow]:
    """Every GPU NVML lists, by UUID. Raises what NVML raises."""
    nvml.nvmlInit()
    try:
        out = {}
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            pids: dict[int, int] = {}
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(h):
                used = getattr(p, "usedGpuMemory", None) or 0
                pids[int(p.pid)] = pids.get(int(p.pid), 0) + int(used) // (1024 * 1024)
            out[uuid] = GpuNow(uuid, i, int(mem.total) // 2**20, int(mem.free) // 2**20, pids)
        return out
    finally:
        nvml.nvmlShutdown()


@frozen
class Deploy:
    """What one deployment of the check asks for."""

    engine: str
    model: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(factory=dict)

    def yaml(self, name: str, served: str, startup_timeout: int, env: Mapping[str, str] | None = None) -> str:
        return "\n".join([f"name: {name}", f"model: {self.model}", f"served_name: {served}",
                          f"engine: {self.engine}", "gpus_per_node: 1", "replicas: 1",
                          f"startup_timeout: {startup_timeout}s", f"args: {json.dumps(list(self.args))}",
                          f"env: {json.dumps({**self.env, **(env or {})})}"]) + "\n"


SLEEP_YAML = """autoscale:
  min: 0
  max: 1
  in_flight_per_replica: 2
  scale_up_after: 1s
  scale_down_after: 2s
  idle_to_zero: 3s
  sleep_when_idle: true
"""


def write_wrapper(path: Path, python: str, script: Path) -> Path:
    """An executable that `engines.vllm.bin` names: its #! line is the Python that has
    torch and llmgw (the agent reads the engine's Python from it), and it execs the
    stand-in in the same process (the pid the agent spawned stays the engine's)."""
    path.write_text(f"#!{python}\nimport os, sys\n"
                    f"os.execv(sys.executable, [sys.executable, {str(script)!r}, *sys.argv[1:]])\n")
    path.chmod(0o755)
    return path


def make_model(root: Path) -> Path:
    """A model folder the stand-in is given (it reads nothing of it): a config.json."""
    model = root / "tiny-standin"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                   "model_type": "llama"}))
    return model


class Side:
    """The GPUs and the engine one run of the check uses."""

    name = ""
    deploy: Deploy
    # Environment for the deployment that is to be killed while it loads: it must load
    # for longer than the check takes to aim.
    slow_env: Mapping[str, str] = {"LLMGW_STANDIN_LOAD_SECONDS": "60"}
    kill_after = 5.0  # seconds after spawn, where no GPU memory shows loading sooner
    standin = True  # the stalling and sleeping steps need the stand-in's knobs

    def agent_kw(self, root: Path) -> dict[str, Any]:
        raise NotImplementedError

    def agent_env(self) -> dict[str, str]:
        return {}

    def read(self) -> dict[str, GpuNow]:
        raise NotImplementedError

    def start_hog(self, root: Path, deadline: Deadline) -> tuple[Proc, dict[str, int]]:
        """A foreign process holding ~85% of every GPU: its Proc and MiB held per UUID."""
        raise NotImplementedError

    def stop_hog(self, hog: Proc) -> None:
        hog.stop(signal.SIGKILL, timeout=10)


HOG = r'''
import sys, time, torch
held = []
for i in range(torch.cuda.device_count()):
    free, total = torch.cuda.mem_get_info(i)
    n = min(int(total * float(sys.argv[1])), free - (512 << 20))
    if n > 0:
        held.append(torch.empty(n, dtype=torch.uint8, device=f"cuda:{i}"))
torch.cuda.synchronize()
print("holding", sum(t.numel() for t in held) >> 20, "MiB", flush=True)
time.sleep(3600)
'''


def torch_hog(python: str, root: Path, deadline: Deadline) -> Proc:
    script = root / "train.py"  # what an operator would see: "python train.py 0.85"
    script.write_text(HOG)
    hog = Proc([python, str(script), str(HOG_FRACTION)], root / "hog.log",
               env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    end = time.monotonic() + deadline.bound(90)
    while "holding" not in hog.text():
        if hog.p.poll() is not None or time.monotonic() > end:
            text = hog.text()[-800:]
            hog.stop(signal.SIGKILL)
            raise RuntimeError(f"the foreign process did not take the memory: {text}")
        time.sleep(POLL)
    return hog


class StandinSide(Side):
    """The lent GPU machine: real NVML, torch, the stand-in for vLLM."""

    name = "standin"

    def __init__(self, root: Path, nvml: Any) -> None:
        self.nvml = nvml
        self.bin = write_wrapper(root / "vllm", sys.executable, STANDIN)
        self.deploy = Deploy("vllm", str(make_model(root)), ("--gpu-memory-utilization", str(UTILIZATION)))

    def agent_kw(self, root: Path) -> dict[str, Any]:
        return {"discovery": {"prefer_nvml": True, "nvidia_smi": "", "interval": "2s"},
                "engines": {"vllm": {"bin": str(self.bin), "launch_mode": "mp"}}}

    def read(self) -> dict[str, GpuNow]:
        return read_gpus(self.nvml)

    def start_hog(self, root: Path, deadline: Deadline) -> tuple[Proc, dict[str, int]]:
        hog = torch_hog(sys.executable, root, deadline)
        return hog, {u: g.pids.get(hog.pid, 0) for u, g in self.read().items()}


class VllmSide(Side):
    """Real vLLM from its venv (a machine that can install it)."""

    name = "vllm"
    slow_env: Mapping[str, str] = {}
    kill_after = 20.0
    standin = False

    def __init__(self, venv: Path, model: Path, nvml: Any) -> None:
        self.venv = venv
        self.nvml = nvml
        # --enforce-eager: no torch.compile nor CUDA-graph capture (minutes on a first start).
        self.deploy = Deploy("vllm", str(model),
                             ("--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "16",
                              "--gpu-memory-utilization", str(UTILIZATION)),
                             {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})

    def agent_kw(self, root: Path) -> dict[str, Any]:
        return {"discovery": {"prefer_nvml": True, "nvidia_smi": "", "interval": "2s"},
                "engines": {"vllm": {"bin": str(self.venv / "bin" / "vllm"), "launch_mode": "mp"}}}

    def read(self) -> dict[str, GpuNow]:
        return read_gpus(self.nvml)

    def start_hog(self, root: Path, deadline: Deadline) -> tuple[Proc, dict[str, int]]:
        hog = torch_hog(str(self.venv / "bin" / "python"), root, deadline)
        return hog, {u: g.pids.get(hog.pid, 0) for u, g in self.read().items()}


class SimulatedSide(Side):
    """The suite's: the stand-in in fake-CUDA mode over a fake NVML's state file."""

    name = "simulated"
    kill_after = 5.0

    def __init__(self, root: Path, gpus: int = 1, total_mib: int = 80 * 1024) -> None:
        self.state = root / "fake-nvml.json"
        self.gpus = gpus
        self.total = total_mib
        self._write({})
        os.environ["LLMGW_FAKE_NVML"] = str(self.state)  # this process reads the same fake
        self.nvml = load_fake_nvml()
        self.bin = write_wrapper(root / "vllm", sys.executable, STANDIN)
        self.deploy = Deploy("vllm", str(make_model(root)), ("--gpu-memory-utilization", str(UTILIZATION)),
                             {"LLMGW_STANDIN_FAKE_CUDA": str(self.state), "LLMGW_SIM_TTFT": "0.01",
                              "LLMGW_SIM_TOKENS_PER_SECOND": "1000"})

    def _write(self, processes: dict[int, list[list[int]]]) -> None:
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpus": self.gpus, "total_mib": self.total,
                                   "processes": {str(k): v for k, v in processes.items()}}))
        os.replace(tmp, self.state)

    def agent_kw(self, root: Path) -> dict[str, Any]:
        return {"discovery": {"prefer_nvml": True, "interval": "1s"},
                "engines": {"vllm": {"bin": str(self.bin), "launch_mode": "mp"}}}

    def agent_env(self) -> dict[str, str]:
        path = os.pathsep.join([str(FAKE_NVML_DIR), os.environ.get("PYTHONPATH", "")])
        return {"PYTHONPATH": path, "LLMGW_FAKE_NVML": str(self.state)}

    def read(self) -> dict[str, GpuNow]:
        return read_gpus(self.nvml.current())

    def start_hog(self, root: Path, deadline: Deadline) -> tuple[Proc, dict[str, int]]:
        script = root / "train.py"
        script.write_text("import time\ntime.sleep(3600)\n")
        hog = Proc([sys.executable, str(script)], root / "hog.log")
        mib = int(self.total * HOG_FRACTION)
        self._write({i: [[hog.pid, mib]] for i in range(self.gpus)})
        return hog, {u: mib for u in self.read()}

    def stop_hog(self, hog: Proc) -> None:
        self._write({})
        super().stop_hog(hog)


def load_fake_nvml() -> Any:
    """The fake pynvml module, loaded by path under a name of its own (a real pynvml
    imported in this process stays as it is)."""
    spec = importlib.util.spec_from_file_location("gpu_check_fake_pynvml", FAKE_NVML_DIR / "pynvml.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {FAKE_NVML_DIR / 'pynvml.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GpuRig:
    """Server, agent (on this machine's GPUs, or the fake's) and router as real processes
    (tests/fakes/live.py's Cluster), driven through `llmgw ctl` and plain HTTP (urllib:
    nothing of the test tier, openai or pytest, is needed on the GPU machine)."""

    def __init__(self, root: Path, side: Side) -> None:
        self.root = root
        self.side = side
        self.c = Cluster(root, heartbeat="1s", lost_after="60s")
        self.agent_kw = side.agent_kw(root)
        self.agent: Proc | None = None
        self.router_url = ""

    def start_agent(self) -> Proc:
        cfg = self.c.agent_config(NODE, **self.agent_kw)
        self.agent = Proc([*LLMGW, "agent", "--config", str(cfg)], cfg.parent / "agent.log",
                          env=self.side.agent_env())
        self.c.procs.append(self.agent)
        return self.agent

    def start_router(self) -> None:
        # A request for an asleep model is held (cold start) while the engine wakes.
        _proc, port = self.c.start_router("edge", extra='load_report_interval = "500ms"\n'
                                                         'cold_start_budget = "60s"\n')
        self.router_url = f"http://127.0.0.1:{port}"

    def apply(self, name: str, served: str, deadline: Deadline, env: Mapping[str, str] | None = None,
              *, startup_timeout: int = 0, extra: str = "") -> None:
        f = self.root / f"{name}.yaml"
        f.write_text(self.side.deploy.yaml(name, served, startup_timeout or max(30, int(deadline.left())),
                                           env) + extra)
        r = self.c.ctl("apply", "-f", str(f))
        if r.returncode != 0:
            raise RuntimeError(f"ctl apply {name}: {r.stderr.strip()}")

    def delete(self, name: str, deadline: Deadline, timeout: float = 60) -> float | None:
        """Delete and wait until its replica is gone: seconds, or None past the bound."""
        t0 = time.monotonic()
        self.c.ctl("delete", "deployment", name)
        gone = poll(lambda: not self.row(f"{name}-0"), deadline.bound(timeout))
        return round(time.monotonic() - t0, 2) if gone else None

    def row(self, rid: str) -> dict[str, Any]:
        """The replica as `ctl get replicas -o json` lists it ({} when it is not)."""
        r = self.c.ctl("get", "replicas", "-o", "json")
        if r.returncode != 0:
            return {}
        return next((x for x in json.loads(r.stdout) if x.get("id") == rid), {})

    def status_row(self, rid: str) -> dict[str, Any]:
        """The replica as `ctl status -o json` lists it (with `asleep`)."""
        return next((x for x in self.status_json().get("replicas", []) if x.get("id") == rid), {})

    def describe(self, rid: str) -> str:
        r = self.c.ctl("describe", "replica", rid)
        return r.stdout + r.stderr

    def status_json(self) -> dict[str, Any]:
        r = self.c.ctl("status", "-o", "json")
        return json.loads(r.stdout) if r.returncode == 0 else {}

    def leader_of(self, rid: str) -> int | None:
        found = [p for p, tag in engine_pids(self.root).items()
                 if tag.startswith(rid + ":") and procs.session_of(p) == p]
        return found[0] if found else None

    def engine_log_of(self, rid: str) -> Path:
        return self.root / "agents" / NODE / "work" / "engines" / rid / "engine.log"

    def http(self, method: str, path: str, body: dict[str, Any] | None = None,
             timeout: float = 60) -> tuple[int, dict[str, Any]]:
        """One request to the router: status and JSON body ({} when not JSON)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.router_url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except OSError as exc:
            return 0, {"error": str(exc)}
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = {"text": raw[:300].decode(errors="replace")}
        return status, doc if isinstance(doc, dict) else {"body": doc}

    def models(self) -> list[str]:
        status, doc = self.http("GET", "/v1/models", timeout=10)
        return [m.get("id") for m in doc.get("data", [])] if status == 200 else []

    def chat(self, model: str, max_tokens: int = 5) -> tuple[int, dict[str, Any]]:
        return self.http("POST", "/v1/chat/completions",
                         {"model": model, "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": "hello"}]})

    def close(self) -> None:
        self.c.close()


def poll(cond: Callable[[], Any], timeout: float, interval: float = POLL) -> Any:
    """cond()'s first truthy value within `timeout` seconds, else None."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() >= end:
            return value or None
        time.sleep(interval)


def alive(pid: int) -> bool:
    """Running: not gone, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def env_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# -- step 5 ------------------------------------------------------------------------------


def cluster_up(rig: GpuRig, deadline: Deadline) -> Outcome:
    """Server, agent and router started; the node ready with its GPUs."""
    fig: dict[str, Any] = {"engine": rig.side.name}
    t0 = time.monotonic()
    rig.c.start_server()
    rig.start_agent()
    node = poll(lambda: next((n for n in rig.status_json().get("nodes", []) if n["id"] == NODE
                              and n["state"] == "ready"), None), deadline.bound(60))
    if not node:
        return Outcome(False, fig, (f"node {NODE} not ready: {tail(rig.root / 'agents' / NODE / 'agent.log')}",))
    fig["gpu_source"] = node.get("gpu_source")
    fig["gpus"] = [g.get("uuid") for g in node.get("gpus", [])]
    fig["up_s"] = round(time.monotonic() - t0, 2)
    rig.start_router()
    if not fig["gpus"]:
        return Outcome(False, fig, (f"node {NODE} reports no GPU",))
    return Outcome(True, fig)


def serve(rig: GpuRig, deadline: Deadline) -> Outcome:
    """The tiny model ready on a GPU through llmgw's plans; a chat completion through
    the router. Then the deployment is deleted (and the seconds until its memory is back
    recorded) so that the GPUs are free for the steps after."""
    fig: dict[str, Any] = {}
    baseline = rig.side.read()
    t1 = time.monotonic()
    rig.apply("tiny", MODEL, deadline)
    ready = poll(lambda: (r := rig.row("tiny-0")).get("state") == "ready" and r, deadline.bound(400), 0.5)
    if not ready:
        row = rig.row("tiny-0")
        return Outcome(False, fig, (f"tiny-0 not ready ({row.get('state')}: {row.get('reason')}); "
                                    f"engine log: {tail(rig.engine_log_of('tiny-0'))}",))
    fig["ready_s"] = round(time.monotonic() - t1, 2)
    fig["replica_gpus"] = ready.get("gpus")
    notes = []
    leader = rig.leader_of("tiny-0")
    cvd = env_of(leader).get("CUDA_VISIBLE_DEVICES") if leader else None
    fig["cuda_visible_devices"] = cvd
    if cvd is None or not CVD.match(cvd):
        notes.append(f"the engine's CUDA_VISIBLE_DEVICES is {cvd!r}, not NVML indices (issue 18, 1)")
    now = rig.side.read()
    uuid = (ready.get("gpus") or [""])[0]
    if uuid in now and leader:
        session = set(procs.session_pids(leader))
        fig["engine_mib"] = sum(m for p, m in now[uuid].pids.items() if p in session)
    if not poll(lambda: MODEL in rig.models(), deadline.bound(30)):
        return Outcome(False, fig, (*notes, "the router never listed the model"))
    t2 = time.monotonic()
    status, chat = rig.chat(MODEL)
    fig["chat_s"] = round(time.monotonic() - t2, 3)
    fig["completion_tokens"] = (chat.get("usage") or {}).get("completion_tokens")
    choice = (chat.get("choices") or [{}])[0]
    if status != 200 or (choice.get("message") or {}).get("role") != "assistant" or fig["completion_tokens"] != 5:
        notes.append(f"unexpected answer ({status}): {json.dumps(chat)[:300]}")
    t3 = time.monotonic()
    gone = rig.delete("tiny", deadline)
    fig["deleted_s"] = gone
    if uuid in baseline:
        back = poll(lambda: (g := rig.side.read().get(uuid)) and g.free >= baseline[uuid].free - 1024,
                    deadline.bound(60))
        fig["memory_back_after_delete_s"] = round(time.monotonic() - t3, 2) if back else None
    if gone is None:
        notes.append("tiny-0 still listed 60 s after ctl delete")
    return Outcome(not notes, fig, tuple(notes))


# -- step 6 ------------------------------------------------------------------------------


def foreign_memory(rig: GpuRig, deadline: Deadline) -> Outcome:
    """A foreign process holds ~85% of every GPU; the deployment `held` must not start,
    and ctl's reason for it (describe: pending reason, or the engine's refusal) must name
    that pid."""
    hog, held = rig.side.start_hog(rig.root, deadline)
    fig: dict[str, Any] = {"pid": hog.pid, "held_mib": held}
    try:
        seen = poll(lambda: all(hog.pid in g.pids for g in rig.side.read().values()), deadline.bound(30))
        fig["nvml_lists_it"] = bool(seen)
        # In a container NVML may list host pids: what it lists, to tell that case apart.
        fig["nvml_pids"] = {u: sorted(g.pids) for u, g in rig.side.read().items()}
        t0 = time.monotonic()
        rig.apply("held", "held", deadline)
        mark = f"pid {hog.pid}"
        started: list[str] = []

        def named() -> str | None:
            row = rig.row("held-0")
            if row.get("state") == "ready":
                started.append("ready")
                return "ready"
            text = rig.describe("held-0")
            return next((ln.strip() for ln in text.splitlines() if mark in ln), None)

        line = poll(named, deadline.bound(60), 0.5)
        fig["seconds"] = round(time.monotonic() - t0, 2)
        row = rig.row("held-0")
        fig["state"] = row.get("state")
        fig["reason"] = line if line != "ready" else row.get("reason")
        if started:
            return Outcome(False, fig, ("held-0 became ready beside the foreign process",))
        if not line:
            return Outcome(False, fig, (f"no reason named {mark} within 60 s; describe says: "
                                        f"{rig.describe('held-0')[-1200:]}",))
        return Outcome(True, fig)
    finally:
        rig.side.stop_hog(hog)
        fig["deleted_s"] = rig.delete("held", deadline, 30)


# -- step 7 ------------------------------------------------------------------------------


def kill_while_loading(rig: GpuRig, deadline: Deadline) -> Outcome:
    """Deploy `loadkill`, SIGKILL its engine's session leader while it loads (once NVML
    shows its session holding GPU memory, or `kill_after` seconds after spawn), then time
    its GPU memory coming back and a replica placed on that GPU again. Placed again
    before the memory is back is a failure (issue 18, 5)."""
    side = rig.side
    fig: dict[str, Any] = {}
    baseline = side.read()
    rig.apply("loadkill", "loadkill", deadline, side.slow_env)
    leader = poll(lambda: rig.leader_of("loadkill-0"), deadline.bound(60), 0.1)
    if not leader:
        row = rig.row("loadkill-0")
        return Outcome(False, fig, (f"no engine spawned for loadkill-0 ({row.get('state')}: "
                                    f"{row.get('reason')})",))
    spawned = time.monotonic()
    row = poll(lambda: (r := rig.row("loadkill-0")).get("gpus") and r, deadline.bound(10))
    if not row:
        return Outcome(False, fig, ("loadkill-0 lists no GPU",))
    uuid, gen = row["gpus"][0], row["generation"]
    fig["gpu"] = uuid

    def holding() -> int:
        session = set(procs.session_pids(leader))
        g = side.read().get(uuid)
        return sum(m for p, m in g.pids.items() if p in session) if g else 0

    held = poll(holding, deadline.bound(side.kill_after), 0.1) or 0
    session = set(procs.session_pids(leader))
    state = rig.row("loadkill-0").get("state")
    os.kill(leader, signal.SIGKILL)
    killed = time.monotonic()
    fig.update(killed_after_s=round(killed - spawned, 2), held_mib_at_kill=held, state_at_kill=state,
               session=sorted(session))
    base_free = baseline[uuid].free if uuid in baseline else 0
    back_at: float | None = None
    placed_at: float | None = None
    end = killed + deadline.bound(120)
    while time.monotonic() < end and (back_at is None or placed_at is None):
        g = side.read().get(uuid)
        if back_at is None and g and not (set(g.pids) & session) and g.free >= base_free - 1024:
            back_at = time.monotonic()
        if placed_at is None:
            # Started again on that GPU: by the server (a new generation) or by the agent
            # restarting it in place (the same generation, a new session leader).
            r = rig.row("loadkill-0")
            again = r.get("generation", 0) > gen or rig.leader_of("loadkill-0") not in (None, leader)
            if again and uuid in r.get("gpus", []) and r.get("state") in ("starting", "ready"):
                placed_at = time.monotonic()
        time.sleep(POLL / 2)
    fig["memory_back_s"] = round(back_at - killed, 2) if back_at else None
    fig["placed_again_s"] = round(placed_at - killed, 2) if placed_at else None
    notes = []
    if state == "ready":
        notes.append("the engine was ready, not loading, when killed")
    if back_at is None:
        g = side.read().get(uuid)
        notes.append(f"GPU memory not back within the bound: {g}")
    if placed_at is None:
        r = rig.row("loadkill-0")
        notes.append(f"no replica placed on {uuid} again ({r.get('state')}: {r.get('reason')})")
    elif back_at is not None and placed_at < back_at and held:
        notes.append(f"placed again {back_at - placed_at:.1f} s before the memory was back")
    fig["deleted_s"] = rig.delete("loadkill", deadline, 30)
    return Outcome(not notes, fig, tuple(notes))


# -- the startup deadline ---------------------------------------------------------------


STALLS = {"silent": {"LLMGW_STANDIN_STALL": "silent"},
          "broadcast": {"LLMGW_STANDIN_STALL": "broadcast", "LLMGW_STANDIN_STALL_EVERY": "1"}}


def startup_deadline(rig: GpuRig, deadline: Deadline) -> Outcome:
    """Two stand-ins that never serve, one after the other (llmgw places whole GPUs),
    each with startup_timeout STALL_TIMEOUT: one silent, one logging vLLM's shm_broadcast
    wait line every second. Each must be stopped as not ready within about STALL_TIMEOUT
    of its spawn, not left starting until supervisor.startup_max (issue 30, 5)."""
    fig: dict[str, Any] = {"startup_timeout_s": STALL_TIMEOUT}
    notes: list[str] = []
    for mode, env in STALLS.items():
        name = f"stall-{mode}"
        fig[mode] = got = stalled_start(rig, name, env, deadline)
        if got.get("problem"):
            notes.append(f"{name}: {got['problem']}")
    return Outcome(not notes, fig, tuple(notes))


def stalled_start(rig: GpuRig, name: str, env: Mapping[str, str], deadline: Deadline) -> dict[str, Any]:
    """Deploy `name` (a stand-in that never serves), time its engine from spawn to its
    end, read the reason, delete it."""
    rid = f"{name}-0"
    fig: dict[str, Any] = {}
    rig.apply(name, name, deadline, env, startup_timeout=STALL_TIMEOUT)
    leader = poll(lambda: rig.leader_of(rid), deadline.bound(60), 0.1)
    if not leader:
        row = rig.row(rid)
        fig["problem"] = f"no engine spawned ({row.get('state')}: {row.get('reason')})"
    else:
        t0 = time.monotonic()
        gone = poll(lambda: not alive(leader), deadline.bound(STALL_TIMEOUT + STALL_SLACK), 0.1)
        took = time.monotonic() - t0
        fig["ended_after_s"] = round(took, 2) if gone else None
        row = rig.row(rid)
        fig["state"], fig["reason"] = row.get("state"), row.get("reason")
        fig["log_tail"] = tail(rig.engine_log_of(rid), 3)
        if not gone:
            fig["problem"] = (f"still running {STALL_TIMEOUT + STALL_SLACK:.0f} s after its spawn with "
                              f"startup_timeout {STALL_TIMEOUT}s: the startup deadline took its log for "
                              "progress" if "broadcast" in name else
                              f"still running {STALL_TIMEOUT + STALL_SLACK:.0f} s after its spawn")
    fig["deleted_s"] = rig.delete(name, deadline, 30)
    return fig


# -- sleep and wake ----------------------------------------------------------------------


def sleep_wake(rig: GpuRig, deadline: Deadline) -> Outcome:
    """autoscale.sleep_when_idle (idle_to_zero 3 s): served once, then idle until the
    status says asleep; NVML's used memory of its GPU awake, asleep (should fall by about
    the engine's budget: weights and KV cache freed, the CUDA context kept) and after a
    request through the router woke it (back up); the engine's pid the same throughout."""
    fig: dict[str, Any] = {}
    notes: list[str] = []
    name, rid = "sleepy", "sleepy-0"
    base = rig.side.read()
    rig.apply(name, name, deadline, extra=SLEEP_YAML)
    ready = poll(lambda: (r := rig.row(rid)).get("state") == "ready" and r, deadline.bound(120), 0.5)
    if not ready:
        row = rig.row(rid)
        return Outcome(False, fig, (f"{rid} not ready ({row.get('state')}: {row.get('reason')}); "
                                    f"engine log: {tail(rig.engine_log_of(rid))}",))
    uuid = (ready.get("gpus") or [""])[0]
    pid = rig.leader_of(rid)
    fig.update(gpu=uuid, pid=pid)
    if not poll(lambda: name in rig.models(), deadline.bound(30)):
        return Outcome(False, fig, ("the router never listed the model",))
    status, _ = rig.chat(name)
    if status != 200:
        notes.append(f"the first request answered {status}")

    def used() -> int | None:
        g = rig.side.read().get(uuid)
        return g.used if g else None

    awake = used()
    fig["used_mib_before"] = base[uuid].used if uuid in base else None
    fig["used_mib_awake"] = awake
    t0 = time.monotonic()
    asleep = poll(lambda: rig.status_row(rid).get("asleep") is True, deadline.bound(60), 0.5)
    fig["asleep_after_s"] = round(time.monotonic() - t0, 2) if asleep else None
    if not asleep:
        fig["deleted_s"] = rig.delete(name, deadline, 30)
        return Outcome(False, fig, (*notes, f"never asleep: {rig.status_row(rid)}"))
    # The engine frees its memory right after /sleep answers: wait for NVML to show it.
    low = poll(lambda: (u := used()) is not None and awake is not None and u < awake - 1024 and u,
               deadline.bound(30))
    fig["used_mib_asleep"] = low or used()
    t1 = time.monotonic()
    status, doc = rig.chat(name)
    fig["wake_request_s"] = round(time.monotonic() - t1, 2)
    fig["wake_status"] = status
    high = poll(lambda: (u := used()) is not None and awake is not None and u >= awake - 1024 and u,
                deadline.bound(30))
    fig["used_mib_woken"] = high or used()
    fig["same_pid"] = rig.leader_of(rid) == pid
    if not low:
        notes.append(f"NVML's used memory did not fall while asleep ({awake} -> {fig['used_mib_asleep']} MiB)")
    if status != 200:
        notes.append(f"the request that should wake it answered {status}: {json.dumps(doc)[:300]}")
    if not high:
        notes.append(f"NVML's used memory not back after the wake ({fig['used_mib_woken']} MiB)")
    if not fig["same_pid"]:
        notes.append("another engine process answered: slept and woken must be the same one")
    fig["deleted_s"] = rig.delete(name, deadline, 30)
    return Outcome(not notes, fig, tuple(notes))


def stop_all(rig: GpuRig) -> None:
    """Every process the check started, by pid (engines by the rig's safety net)."""
    try:
        rig.close()
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"cleanup: {exc}", file=sys.stderr)
