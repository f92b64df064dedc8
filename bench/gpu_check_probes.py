"""The GPU check's steps that need no cluster: every NVML call llmgw makes, as a raw
table; CUDA's numbering against NVML's, read from a child process; the pre-flight probe
at world size 1.

Each is a function of its inputs (an nvml object, a Python, a deadline) returning an
Outcome. `nvml_calls` runs against the fake NVML in the suite; the other two need torch
with CUDA and run on the GPU machine only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from gpu_check_steps import Deadline, Outcome

from llmgw.agent.engines import preflight

REPR_MAX = 300
PROBE_TIMEOUT = 120.0


# -- nvml_calls ----------------------------------------------------------------------------


def shown(value: Any) -> Any:
    """A JSON-able picture of what an NVML call returned: ctypes structures as their
    fields, bytes decoded, lists element-wise, anything else its repr (bounded)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [shown(v) for v in value[:64]]
    fields = getattr(value, "_fields_", None)
    if fields:
        return {f[0]: shown(getattr(value, f[0], None)) for f in fields}
    if hasattr(value, "__dict__") and not callable(value):
        return {k: shown(v) for k, v in vars(value).items() if not k.startswith("_")}
    return repr(value)[:REPR_MAX]


class Recorder:
    """An nvml module that records every nvml* call made through it: which of llmgw's
    readers made it, its arguments, what it returned or raised, how long it took."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self.reader = ""
        self.calls: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._nvml, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr  # constants, NVMLError, the ctypes structures

        def call(*args: Any, **kw: Any) -> Any:
            row: dict[str, Any] = {"reader": self.reader, "call": name,
                                   "args": [repr(a)[:80] for a in args]}
            t0 = time.perf_counter()
            try:
                out = attr(*args, **kw)
            except BaseException as exc:
                row["raised"] = f"{type(exc).__name__}: {exc}"[:REPR_MAX]
                raise
            else:
                row["returned"] = shown(out)
                return out
            finally:
                row["ms"] = round((time.perf_counter() - t0) * 1000, 3)
                self.calls.append(row)

        return call


def llmgw_readers(pci_root: str) -> list[tuple[str, Callable[[Any], Any]]]:
    """Every place llmgw's agent reads NVML, as (name, function of an nvml module): the
    inventory (discovery.gpus), the spawn-time and release memory reads
    (discovery.nvml.read_gpu_memory), the utilisation sampler (gpu_usage.read_usage) and
    the Xid watch (xid._Watch: open, one wait, close)."""
    from llmgw.agent.discovery import gpus, nvml
    from llmgw.agent.gpus import usage as gpu_usage
    from llmgw.agent.gpus import xid

    def xid_watch(n: Any) -> Any:
        watch = xid._Watch.open(n)
        if watch is None:
            return "no event set"
        try:
            return watch.wait()
        finally:
            watch.close()

    def usage(n: Any) -> Any:
        n.nvmlInit()  # as GpuSampler opens its session before read_usage
        try:
            return gpu_usage.read_usage(n)
        finally:
            n.nvmlShutdown()

    return [("discovery.gpus._try_nvml", lambda n: gpus._try_nvml(n, pci_root)),
            ("discovery.nvml.read_gpu_memory", nvml.read_gpu_memory),
            ("gpu_usage.read_usage", usage),
            ("xid._Watch", xid_watch)]


def nvml_calls(nvml: Any | None, pci_root: str) -> Outcome:
    """Each of llmgw's NVML readers run once through a Recorder: the raw table of calls
    (figures.calls) and, per reader, what it made of them or what it raised. Passes when
    every reader returned: an NVML error inside one is data (the table shows it), a reader
    that raised is a failure."""
    if nvml is None:
        return Outcome(False, notes=("nvidia-ml-py (pynvml) not importable",))
    rec = Recorder(nvml)
    readers: dict[str, str] = {}
    notes = []
    for name, read in llmgw_readers(pci_root):
        rec.reader = name
        try:
            readers[name] = repr(read(rec))[:2000]
        except Exception as exc:  # llmgw's reader itself failed: that is the finding
            readers[name] = f"raised {type(exc).__name__}: {exc}"
            notes.append(f"{name} raised {type(exc).__name__}: {exc}")
    raised: dict[str, int] = {}
    for row in rec.calls:
        if "raised" in row:
            raised[row["call"]] = raised.get(row["call"], 0) + 1
    fig = {"calls": rec.calls, "readers": readers,
           "distinct_calls": sorted({r["call"] for r in rec.calls}), "raised_by_call": raised}
    return Outcome(not notes and bool(rec.calls), fig, tuple(notes) or (
        () if rec.calls else ("no NVML call was made",)))


# -- cuda_numbering ----------------------------------------------------------------------------

# The child: CUDA's devices as torch lists them under the environment it is given.
CUDA_LIST = ("import json, torch\n"
             "out = []\n"
             "for i in range(torch.cuda.device_count()):\n"
             "    p = torch.cuda.get_device_properties(i)\n"
             "    out.append({'index': i, 'uuid': str(p.uuid), 'name': p.name,\n"
             "                'pci': [getattr(p, 'pci_domain_id', -1), getattr(p, 'pci_bus_id', -1),\n"
             "                        getattr(p, 'pci_device_id', -1)]})\n"
             "print(json.dumps(out))\n")


def bare_uuid(u: str) -> str:
    return u.lower().removeprefix("gpu-")


def cuda_devices(python: str, env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    p = subprocess.run([python, "-c", CUDA_LIST], capture_output=True, text=True, timeout=timeout,
                       env=env, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"torch in a child exited {p.returncode}: {p.stderr.strip()[-800:]}")
    found = json.loads(p.stdout.strip().splitlines()[-1])
    return found if isinstance(found, list) else []


def cuda_numbering(nvml_uuids: dict[int, str], deadline: Deadline, python: str = sys.executable) -> Outcome:
    """CUDA's device i against NVML's index i, from child processes as an engine gets
    them: CUDA_DEVICE_ORDER=PCI_BUS_ID with no CUDA_VISIBLE_DEVICES (every device: the
    same UUID at every index), then CUDA_VISIBLE_DEVICES=<n> for each NVML index n (device
    0 must be NVML's n: what the agent's integer CUDA_VISIBLE_DEVICES relies on)."""
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env = {**base, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    listed = cuda_devices(python, env, deadline.bound(PROBE_TIMEOUT))
    fig: dict[str, Any] = {"nvml": nvml_uuids, "cuda_pci_bus_order": listed, "one_visible": {}}
    notes = []
    if len(listed) != len(nvml_uuids):
        notes.append(f"CUDA lists {len(listed)} devices, NVML {len(nvml_uuids)}")
    for d in listed:
        want = nvml_uuids.get(d["index"], "")
        if bare_uuid(d["uuid"]) != bare_uuid(want):
            notes.append(f"CUDA device {d['index']} is {d['uuid']}, NVML index {d['index']} is {want}")
    for n, want in sorted(nvml_uuids.items()):
        got = cuda_devices(python, {**env, "CUDA_VISIBLE_DEVICES": str(n)}, deadline.bound(PROBE_TIMEOUT))
        fig["one_visible"][str(n)] = got[0]["uuid"] if got else None
        if not got or bare_uuid(got[0]["uuid"]) != bare_uuid(want):
            notes.append(f"CUDA_VISIBLE_DEVICES={n} shows {got[0]['uuid'] if got else 'no device'}, "
                         f"NVML index {n} is {want}")
    return Outcome(not notes and bool(listed), fig, tuple(notes) or (
        () if listed else ("torch lists no CUDA device",)))


# -- preflight -----------------------------------------------------------------------------------


def probe_settings(port: int, timeout: float) -> dict[str, Any]:
    """What the agent gives the probe (preflight.probe_process's settings) for one node,
    one rank: the GPU sizes over NCCL."""
    return {"nnodes": 1, "node_rank": 0, "master_addr": preflight.LOOPBACK, "master_port": port,
            "gpu_sizes": list(preflight.GPU_SIZES), "gpu_iters": preflight.GPU_ITERS,
            "cpu_sizes": list(preflight.CPU_SIZES), "cpu_iters": preflight.CPU_ITERS,
            "timeout": timeout, "local_ranks": 1}


def preflight_probe(port: int, deadline: Deadline, python: str = sys.executable,
                    want_backend: str = "nccl") -> Outcome:
    """llmgw's pre-flight probe (llmgw/agent/insession/preflight_probe.py, the file the agent runs)
    at world size 1 on GPU 0, read back with the agent's own parser. Passes when it
    passed on `want_backend`."""
    from llmgw.agent.insession import preflight_probe

    timeout = deadline.bound(PROBE_TIMEOUT)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
           preflight.PROBE_ENV: json.dumps(probe_settings(port, timeout))}
    t0 = time.monotonic()
    try:
        p = subprocess.run([python, str(preflight_probe.__file__)], capture_output=True, text=True,
                           timeout=timeout + 10, env=env, check=False)
    except subprocess.TimeoutExpired:
        return Outcome(False, notes=(f"the probe ran past {timeout:.0f} s",))
    result = preflight.parse_output(p.stdout)
    fig = {"exit": p.returncode, "seconds": round(time.monotonic() - t0, 2), "line": result.line(),
           **preflight.result_doc(result), "stderr": p.stderr.strip()[-1500:]}
    notes = []
    if not result.ok:
        notes.append(f"probe {result.line()}")
    elif result.backend != want_backend:
        notes.append(f"the probe ran {result.backend}, not {want_backend}")
    return Outcome(not notes, fig, tuple(notes))
