"""The pre-flight of a gang member, or of a single-node tensor-parallel replica (pure):
the probe process to run before the engine, and what its output says.

The probe (llmgw/agent/insession/preflight_probe.py) runs under the engine's own Python with the
engine's own environment — the same CUDA_VISIBLE_DEVICES, NCCL_*/GLOO_* interfaces,
NCCL_IB_HCA and UCX_NET_DEVICES — and meets its peers at the head's rendezvous address
and port (the engine's own, free until the engine starts). The launcher
(llmgw.agent.insession.launcher) runs it first, bounded by `timeout`, writes what it found to the
engine's folder and its log, and starts the engine only when it passed (or, best
effort, whatever it found).

One node (a deployment of nodes: 1 and several GPUs that sets `preflight`, carried by
EngineSpec.preflight*): the probe runs on that node alone, one rank per placed GPU (world
size = the GPU count, local_ranks), meeting on 127.0.0.1 at a port of the replica's own:
the last of its engine block (vLLM takes at most 15 of the 16, SGLang 8), else, for an
engine with no block (the simulated one), its HTTP port, which the engine binds only after.
There the all-reduce rides NVLink or PCIe, not a fabric: NVLink's rate is not the fabric's
`rate_gbps`, and no rate of it is known to the agent, so no default floor applies (no
nccl_floor_gbps); only the deployment's preflight_min_busbw judges the bandwidth.

Sizes: 1 MiB to 256 MiB on GPUs, as the multi-node pre-flight asks (small sizes show latency, the large one
the links' bandwidth); on CPU, 64 KiB to 4 MiB, since Gloo over loopback or Ethernet is
only checked for correctness and a bounded time.
"""

from __future__ import annotations

import json
import re
from typing import Any

from attrs import evolve, frozen

from llmgw.agent.engines.plan import Preflight, ProcessPlan
from llmgw.errors import EngineError
from llmgw.model.deployment import ENGINE_PORT_BLOCK
from llmgw.model.engine import EngineKind, EngineSpec
from llmgw.model.preflight import PORT_IN_USE

PROBE_ENV = "LLMGW_PREFLIGHT"  # the probe's settings (preflight_probe.ENV)
TAG = "LLMGW_PREFLIGHT"  # the probe's result line (preflight_probe.TAG)
RESULT_FILE = "preflight.json"  # in the engine's folder
GPU_SIZES = (1 << 20, 16 << 20, 256 << 20)
CPU_SIZES = (64 << 10, 1 << 20, 4 << 20)
GPU_ITERS = 5
CPU_ITERS = 3
DEFAULT_TIMEOUT = 60.0
MODES = ("required", "best_effort", "off")
PROBE_MODULE = "llmgw.agent.insession.preflight_probe"  # its file is what runs, not the module

# What ProbeResult.fault says a failure was, beyond "the probe failed" (the default, ""):
# the rendezvous port was held by another process (the port's fault, not the nodes': the
# server places the replica again on another port and avoids no node), or NCCL crossed
# nodes over TCP sockets on a gang that has HCAs (the nodes' RDMA: they are avoided).
PORT_FAULT = "port_in_use"
SOCKET_FAULT = "nccl_socket"
# For a gang with HCAs the probe's NCCL says which network it crossed nodes on: INFO
# lines of its INIT and NET subsystems, on the probe's output (not a deployment's file).
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
NO_PYTHON = ("no Python was found to run the pre-flight probe with ({key} names none that "
             "resolves: neither a python, nor a #! line naming one, nor pip's /bin/sh "
             "trampoline to one); set engines.preflight_python")
PYTHON_KEYS = {EngineKind.VLLM: "engines.vllm.bin", EngineKind.SGLANG: "engines.sglang.python",
               EngineKind.SIMULATED: "engines.simulated_python"}


# The default floor: this fraction of what the member's HCAs carry at the fabric's rate.
# nccl-tests' all-reduce across nodes reaches 80-90% of the NICs' line rate in bus
# bandwidth on a healthy fabric; half of it is a link down to a lower speed, a GPU on the
# wrong side of the CPU, or traffic over TCP instead of RDMA.
FLOOR_FRACTION = 0.5


def nccl_floor(rate_gbps: float, hcas: int) -> float:
    """GB/s of bus bandwidth below which an NCCL probe fails by default: FLOOR_FRACTION of
    `hcas` HCAs at `rate_gbps` (Gb/s, the fabric's configured rate); 0 when unknown."""
    if rate_gbps <= 0 or hcas <= 0:
        return 0.0
    return FLOOR_FRACTION * rate_gbps / 8 * hcas


LOOPBACK = "127.0.0.1"  # a single-node probe's rendezvous: every rank is on this node


@frozen
class ProbeSettings:
    """What `spec` asks of its pre-flight (settings_of): the mode, its bounds, and where
    its ranks meet."""

    required: bool
    timeout: float
    min_busbw_gbps: float
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    # Ranks on this node (one per placed GPU) for a single-node probe; 0: as today's gang
    # probe, one per GPU torch sees, one on CPU.
    local_ranks: int = 0
    # The gang's HCAs on this node: NCCL must cross nodes over them, not TCP sockets.
    hcas: tuple[str, ...] = ()


def settings_of(spec: EngineSpec) -> ProbeSettings | None:
    """The pre-flight `spec` asks for; None: none. A gang member's, as its GangSpec says
    (more than one node); else a single-node replica's, as EngineSpec.preflight says, on
    more than one GPU (one has nothing to probe)."""
    gang = spec.gang
    if gang is not None:
        if gang.nnodes <= 1 or gang.preflight not in ("required", "best_effort"):
            return None
        return ProbeSettings(gang.preflight == "required", gang.preflight_timeout,
                             gang.preflight_min_busbw, gang.nnodes, gang.rank,
                             gang.head_addr, gang.rendezvous_port, hcas=gang.hcas)
    if spec.preflight not in ("required", "best_effort") or len(spec.gpus) < 2:
        return None
    return ProbeSettings(spec.preflight == "required", spec.preflight_timeout,
                         spec.preflight_min_busbw, 1, 0, LOOPBACK, local_port(spec),
                         local_ranks=len(spec.gpus))


def local_port(spec: EngineSpec) -> int:
    """A single-node probe's rendezvous port: the last of the engine's reserved block (no
    engine of ours takes it), else the engine's HTTP port (free until the engine starts,
    and bound with SO_REUSEADDR by the simulated engine, the one without a block)."""
    return spec.port_base + ENGINE_PORT_BLOCK - 1 if spec.port_base else spec.port


def preflight_for(spec: EngineSpec, env: dict[str, str], python: str, script: str,
                  cwd: str, nccl_floor_gbps: float = 0.0) -> Preflight | None:
    """The pre-flight a plan carries, as settings_of reads `spec`; None: none.
    `nccl_floor_gbps`: the floor where the deployment sets none and the probe ran NCCL
    (a gang's, from its fabric; 0 on one node, where no fabric is crossed)."""
    want = settings_of(spec)
    if want is None:
        return None
    if not python and want.required:
        # Refused, not skipped: an engine whose required check silently never ran is what
        # `required` is there to prevent.
        raise EngineError(f"replica {spec.replica_id}: pre-flight is required, and "
                          + NO_PYTHON.format(key=PYTHON_KEYS.get(spec.engine, "the engine's command")))
    # Best effort with no Python: the launcher says so in the log (preflight_run), and the
    # engine starts as best effort does on any failed probe.
    proc = probe_process(spec, env, python, script, cwd, want.timeout)
    return Preflight(proc, timeout=want.timeout, required=want.required,
                     min_busbw_gbps=want.min_busbw_gbps,
                     result_path=f"{cwd}/{RESULT_FILE}" if cwd else RESULT_FILE,
                     nccl_floor_gbps=nccl_floor_gbps if spec.gang is not None else 0.0)


def floor_for(result: ProbeResult, min_busbw_gbps: float, nccl_floor_gbps: float) -> float:
    """The floor `result` is judged by: the deployment's, else the default where the probe
    ran NCCL (on CPU, Gloo over Ethernet or loopback says nothing of the fabric)."""
    if min_busbw_gbps > 0:
        return min_busbw_gbps
    return nccl_floor_gbps if result.backend == "nccl" else 0.0


def probe_process(spec: EngineSpec, env: dict[str, str], python: str, script: str, cwd: str,
                  timeout: float = DEFAULT_TIMEOUT) -> ProcessPlan:
    """The probe as a process: `python script`, the engine's `env` with the probe's
    settings added. `spec` must ask for a pre-flight (settings_of)."""
    want = settings_of(spec)
    assert want is not None, "no pre-flight asked for"
    # Both sets: the probe takes the GPU one only where torch sees the GPUs (NCCL), so a
    # CPU-only torch (CI, the simulated engine) runs Gloo at the small sizes.
    settings: dict[str, Any] = {
        "nnodes": want.nnodes,
        "node_rank": want.node_rank,
        "master_addr": want.master_addr,
        "master_port": want.master_port,
        "gpu_sizes": list(GPU_SIZES),
        "gpu_iters": GPU_ITERS,
        "cpu_sizes": list(CPU_SIZES),
        "cpu_iters": CPU_ITERS,
        "timeout": timeout,
    }
    if want.local_ranks:
        settings["local_ranks"] = want.local_ranks
    probe_env = dict(env)
    if want.hcas:
        # The launcher reads the network NCCL chose from these lines (net_verdict); a
        # deployment's NCCL_DEBUG_FILE would take them off the probe's output.
        settings["hcas"] = list(want.hcas)
        probe_env.pop("NCCL_DEBUG_FILE", None)
        probe_env.update(NCCL_DEBUG_ENV)
    return ProcessPlan("preflight", (python, script), {**probe_env, PROBE_ENV: json.dumps(settings)}, cwd)


@frozen
class SizeResult:
    bytes: int
    seconds: float  # per all-reduce, the slowest rank's
    algbw_gbps: float
    busbw_gbps: float


@frozen
class ProbeResult:
    """What one member's probe said. `ok` false: `error` says why (the probe's own, or
    "timed out after 60s", or "no result line")."""

    ok: bool
    error: str = ""
    backend: str = ""
    world: int = 0
    results: tuple[SizeResult, ...] = ()
    seconds: float = 0.0  # the probe's whole run
    fault: str = ""  # a failure's kind: PORT_FAULT, SOCKET_FAULT; "": any other
    port: int = 0  # PORT_FAULT: the rendezvous port another process held

    @property
    def busbw_gbps(self) -> float:
        """The bus bandwidth at the largest size: the figure compared with the links'."""
        return max(self.results, key=lambda r: r.bytes).busbw_gbps if self.results else 0.0

    def line(self) -> str:
        """One line for the log, `describe` and status: "passed: gloo x2, 4 MiB at
        1.15 GB/s bus bandwidth, in 2.0s" or "failed: <why>"."""
        if not self.ok:
            return f"failed: {self.error}"
        if not self.results:
            return f"passed: {self.backend} x{self.world}, in {self.seconds:.1f}s"
        big = max(self.results, key=lambda r: r.bytes)
        return (f"passed: {self.backend} x{self.world}, {_size(big.bytes)} at "
                f"{big.busbw_gbps:.3g} GB/s bus bandwidth, in {self.seconds:.1f}s")


def _size(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):g} MiB"
    return f"{n / (1 << 10):g} KiB"


def _num(doc: dict[str, Any], key: str, kind: type = float) -> Any:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{key} is {v!r}")
    return kind(v)


# How a bind of a taken port reads in the probe's error: torch's TCPStore says "code: -98,
# name: EADDRINUSE, message: address already in use" (DistNetworkError, checked against
# torch 2.13's); Python's own socket errors say "[Errno 98] Address already in use".
_IN_USE = re.compile(r"EADDRINUSE|address already in use|\[Errno 98\]", re.IGNORECASE)
_PORT_IN_TEXT = re.compile(r"\bport:? (\d{1,5})\b")


def port_fault(error: str, port: int = 0) -> int:
    """The port a probe's `error` says was in use (torch's "port: N", else `port`, the
    rendezvous port it was given); 0 when the error is not a port in use."""
    if not _IN_USE.search(error):
        return 0
    m = _PORT_IN_TEXT.search(error)
    found = int(m.group(1)) if m else port
    return found if 0 < found < 65536 else 0


def _failed(doc: dict[str, Any], rendezvous_port: int) -> ProbeResult:
    err = doc.get("error")
    text = str(err)[:300] if err else "the probe failed"
    backend = str(doc.get("backend", ""))[:16]
    given = doc.get("port")
    if isinstance(given, int) and not isinstance(given, bool):
        rendezvous_port = given
    port = port_fault(text, rendezvous_port)
    if port:
        return ProbeResult(False, f"{PORT_IN_USE.format(port)} ({text})", backend=backend,
                           fault=PORT_FAULT, port=port)
    return ProbeResult(False, text, backend=backend)


def parse_output(text: str, rendezvous_port: int = 0) -> ProbeResult:
    """The probe's result from its output (the last `LLMGW_PREFLIGHT {json}` line); total:
    anything else is a failed result saying what was wrong, never an exception. A failure
    to bind the rendezvous port (`rendezvous_port`, where the probe's line names none) is
    a PORT_FAULT carrying that port."""
    line = ""
    for x in text.splitlines():
        if x.startswith(TAG + " "):
            line = x[len(TAG) + 1:]
    if not line:
        return ProbeResult(False, "the probe printed no result")
    try:
        doc = json.loads(line)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        if doc.get("ok") is not True:
            return _failed(doc, rendezvous_port)
        results = []
        for r in doc.get("results") or ():
            if not isinstance(r, dict):
                raise ValueError("a result is not an object")
            results.append(SizeResult(_num(r, "bytes", int), _num(r, "seconds"),
                                      _num(r, "algbw_gbps"), _num(r, "busbw_gbps")))
        return ProbeResult(True, backend=str(doc.get("backend", ""))[:16],
                           world=_num(doc, "world", int), results=tuple(results),
                           seconds=_num(doc, "seconds") if "seconds" in doc else 0.0)
    except ValueError as exc:
        return ProbeResult(False, f"unreadable result: {exc}")


# NCCL's own INFO lines (src/init.cc, src/transport/net.cc, NCCL 2.x): "Using network IB"
# once per communicator, and per channel "Channel 00/0 : 0[0] -> 1[0] [send] via
# NET/IB/0/GDRDMA" (a plugin's name in place of IB, e.g. "AWS Libfabric"); the built-in
# TCP transport's name is "Socket".
_USING = re.compile(r"NCCL INFO Using network (\S[^\r\n]*?)\s*$")
_VIA = re.compile(r"\bvia NET/([^/\r\n]+)/")
SOCKET = "Socket"


def nccl_networks(text: str) -> tuple[str, ...]:
    """The networks NCCL's INFO lines in `text` say it used, in the order first seen."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        m = _USING.search(line) or _VIA.search(line)
        if m:
            seen.setdefault(m.group(1).strip()[:40], None)
    return tuple(seen)


def net_verdict(result: ProbeResult, text: str, hcas: tuple[str, ...]) -> ProbeResult:
    """`result`, failed when NCCL crossed nodes over TCP sockets although the gang has
    `hcas`: NCCL falls back to its Socket transport without an error when it finds no
    usable IB device (a port down, a wrong NCCL_IB_HCA, no RDMA driver in the container),
    and the collective works, only at a fraction of the fabric's rate. No NCCL lines
    (a CPU probe, Gloo) say nothing: the result stands. A plugin network (not IB, not
    Socket) passes: NCCL_NET=IB is not forced, which would refuse such a fabric."""
    if not result.ok or result.backend != "nccl" or not hcas:
        return result
    nets = nccl_networks(text)
    if SOCKET not in nets:
        return result
    return evolve(result, ok=False, fault=SOCKET_FAULT,
                  error=f"NCCL used TCP sockets (NET/{SOCKET}), not the gang's HCAs "
                        f"{','.join(hcas)[:80]}: RDMA is not in use on this node "
                        "(is an HCA down, NCCL_IB_HCA wrong, or the RDMA driver missing?)")


def verdict(result: ProbeResult, min_busbw_gbps: float) -> ProbeResult:
    """`result`, failed when its bus bandwidth is under `min_busbw_gbps` (0: no floor)."""
    if result.ok and min_busbw_gbps > 0 and result.busbw_gbps < min_busbw_gbps:
        return ProbeResult(False, f"bus bandwidth {result.busbw_gbps:.3g} GB/s is below "
                                  f"{min_busbw_gbps:.3g} GB/s", result.backend, result.world,
                           result.results, result.seconds)
    return result


def result_doc(result: ProbeResult) -> dict[str, Any]:
    """What the launcher writes to RESULT_FILE (and the agent reads back)."""
    return {
        "ok": result.ok, "error": result.error, "backend": result.backend,
        "world": result.world, "seconds": result.seconds, "line": result.line(),
        "fault": result.fault, "port": result.port,
        "results": [{"bytes": r.bytes, "seconds": r.seconds, "algbw_gbps": r.algbw_gbps,
                     "busbw_gbps": r.busbw_gbps} for r in result.results],
    }
