"""The GPU check's steps 5-7: llmgw's real processes (server, agent, router) with an engine
on the GPUs, through llmgw's own launch plans.

5. serve: a chat completion through the router with the `openai` client.
6. foreign_memory: a process that is no engine of llmgw holds ~85% of every GPU; a
   deployment that would land there is refused, and the reason names that pid.
7. kill_while_loading: an engine SIGKILLed while it loads; the seconds until its GPU
   memory is back (NVML) and until a replica is placed on that GPU again.

Two sides stand behind the same steps (`Side`): `VllmSide`, real vLLM with real pynvml
and a torch process as the foreign holder; `SimulatedSide`, llmgw's simulated engine
with the agent's NVML faked from a state file (bench/gpu_check_fake_nvml/pynvml.py), in
which the check lists a sleeping process as the holder. The rig and cluster are the
real-engine tier's (tests/real_engine/test_vllm_live.py Rig, tests/fakes/live.py).
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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from attrs import frozen
from gpu_check_steps import REPO, Deadline, Outcome

sys.path.insert(0, str(REPO / "tests"))

from fakes.live import LLMGW, Proc, engine_pids  # noqa: E402
from llmgw.agent import procs  # noqa: E402
from real_engine.test_vllm_live import MODEL, Rig  # noqa: E402

FAKE_NVML_DIR = Path(__file__).resolve().parent / "gpu_check_fake_nvml"
NODE = "gpu-1"
POLL = 0.25
HOG_FRACTION = 0.85
CVD = re.compile(r"^\d+(,\d+)*$")


@frozen
class GpuNow:
    """One GPU as the check's own NVML read sees it (not llmgw's code: the measure
    must not be the thing measured)."""

    uuid: str
    index: int
    total: int  # MiB
    free: int  # MiB
    pids: dict[int, int]  # compute process -> MiB


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
    env: Mapping[str, str] = {}
    gpu_memory_min: int = 0  # MiB

    def yaml(self, name: str, served: str, startup_timeout: int, env: Mapping[str, str] | None = None) -> str:
        lines = [f"name: {name}", f"model: {self.model}", f"served_name: {served}",
                 f"engine: {self.engine}", "gpus_per_node: 1", "replicas: 1",
                 f"startup_timeout: {startup_timeout}s", f"args: {json.dumps(list(self.args))}",
                 f"env: {json.dumps({**self.env, **(env or {})})}"]
        if self.gpu_memory_min:
            lines.append(f"gpu_memory_min: {self.gpu_memory_min}")
        return "\n".join(lines) + "\n"


class Side:
    """The GPUs and the engine one run of the check uses."""

    name = ""
    deploy: Deploy
    # Environment for the deployment that is to be killed while it loads: it must load
    # for longer than the check takes to aim.
    slow_env: Mapping[str, str] = {}
    kill_after = 3.0  # seconds after spawn, where no GPU memory shows loading sooner

    def agent_kw(self) -> dict[str, Any]:
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


class VllmSide(Side):
    name = "vllm"

    def __init__(self, venv: Path, model: Path, nvml: Any) -> None:
        self.venv = venv
        self.nvml = nvml
        # --enforce-eager: no torch.compile nor CUDA-graph capture (minutes on a first
        # start); 0.3 of the GPU leaves the foreign process's 85% enough to refuse.
        self.deploy = Deploy("vllm", str(model),
                             ("--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "16",
                              "--gpu-memory-utilization", "0.3"),
                             {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        self.kill_after = 20.0

    def agent_kw(self) -> dict[str, Any]:
        return {"discovery": {"prefer_nvml": True, "nvidia_smi": "", "interval": "2s"},
                "engines": {"vllm": {"bin": str(self.venv / "bin" / "vllm"), "launch_mode": "mp"}}}

    def read(self) -> dict[str, GpuNow]:
        return read_gpus(self.nvml)

    def start_hog(self, root: Path, deadline: Deadline) -> tuple[Proc, dict[str, int]]:
        script = root / "train.py"  # what an operator would see: "python train.py 0.85"
        script.write_text(HOG)
        hog = Proc([str(self.venv / "bin" / "python"), str(script), str(HOG_FRACTION)], root / "hog.log",
                   env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        end = time.monotonic() + deadline.bound(90)
        while "holding" not in hog.text():
            if hog.p.poll() is not None or time.monotonic() > end:
                text = hog.text()[-800:]
                hog.stop(signal.SIGKILL)
                raise RuntimeError(f"the foreign process did not take the memory: {text}")
            time.sleep(POLL)
        return hog, {u: g.pids.get(hog.pid, 0) for u, g in self.read().items()}


class SimulatedSide(Side):
    name = "simulated"
    slow_env = {"LLMGW_SIM_LOAD_SECONDS": "60"}
    kill_after = 1.0

    def __init__(self, root: Path, gpus: int = 1, total_mib: int = 80 * 1024) -> None:
        self.state = root / "fake-nvml.json"
        self.gpus = gpus
        self.total = total_mib
        self._write({})
        os.environ["LLMGW_FAKE_NVML"] = str(self.state)  # this process reads the same fake
        self.nvml = load_fake_nvml()
        # Placement and the supervisor count gpu_memory_min as need; the simulated engine
        # asks for no share of its own.
        self.deploy = Deploy("simulated", "org/tiny", (),
                             {"LLMGW_SIM_LOAD_SECONDS": "0.2", "LLMGW_SIM_TTFT": "0.01",
                              "LLMGW_SIM_TOKENS_PER_SECOND": "1000"},
                             gpu_memory_min=int(total_mib * 0.3))

    def _write(self, processes: dict[int, list[list[int]]]) -> None:
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpus": self.gpus, "total_mib": self.total,
                                   "processes": {str(k): v for k, v in processes.items()}}))
        os.replace(tmp, self.state)

    def agent_kw(self) -> dict[str, Any]:
        return {"discovery": {"prefer_nvml": True, "interval": "1s"}}

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


class GpuRig(Rig):
    """The real-engine tier's Rig with the agent on this machine's GPUs (or the fake's)."""

    def __init__(self, root: Path, side: Side) -> None:
        super().__init__(root, root, root)
        self.side = side
        self.agent_kw = side.agent_kw()

    def start_agent(self) -> Proc:
        cfg = self.c.agent_config(NODE, **self.agent_kw)
        self.agent = Proc([*LLMGW, "agent", "--config", str(cfg)], cfg.parent / "agent.log",
                          env=self.side.agent_env())
        self.c.procs.append(self.agent)
        return self.agent

    def apply(self, name: str, served: str, deadline: Deadline, env: Mapping[str, str] | None = None) -> None:
        f = self.root / f"{name}.yaml"
        f.write_text(self.side.deploy.yaml(name, served, max(30, int(deadline.left())), env))
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
        r = self.c.ctl("get", "replicas", "-o", "json")
        if r.returncode != 0:
            return {}
        return next((x for x in json.loads(r.stdout) if x.get("id") == rid), {})

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


def poll(cond: Callable[[], Any], timeout: float, interval: float = POLL) -> Any:
    """cond()'s first truthy value within `timeout` seconds, else None."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() >= end:
            return value or None
        time.sleep(interval)


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
    c = rig.client()
    if not poll(lambda: MODEL in [m.id for m in c.models.list().data], deadline.bound(30)):
        return Outcome(False, fig, (*notes, "the router never listed the model"))
    t2 = time.monotonic()
    chat = c.chat.completions.create(model=MODEL, max_tokens=5,
                                     messages=[{"role": "user", "content": "hello"}])
    fig["chat_s"] = round(time.monotonic() - t2, 3)
    fig["completion_tokens"] = chat.usage.completion_tokens if chat.usage else None
    if chat.choices[0].message.role != "assistant" or fig["completion_tokens"] != 5:
        notes.append(f"unexpected answer: {chat.model_dump_json()[:300]}")
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


def stop_all(rig: GpuRig) -> None:
    """Every process the check started, by pid (engines by the rig's safety net)."""
    try:
        rig.close()
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"cleanup: {exc}", file=sys.stderr)
