"""The pre-flight of a gang member, or of a single-node tensor-parallel replica (pure):
the probe process to run before the engine, and what its output says.

The probe (llmgw/agent/preflight_probe.py) runs under the engine's own Python with the
engine's own environment — the same CUDA_VISIBLE_DEVICES, NCCL_*/GLOO_* interfaces,
NCCL_IB_HCA and UCX_NET_DEVICES — and meets its peers at the head's rendezvous address
and port (the engine's own, free until the engine starts). The launcher
(llmgw.agent.launcher) runs it first, bounded by `timeout`, writes what it found to the
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

Sizes: 1 MiB to 256 MiB on GPUs, as issue 22 asks (small sizes show latency, the large one
the links' bandwidth); on CPU, 64 KiB to 4 MiB, since Gloo over loopback or Ethernet is
only checked for correctness and a bounded time.
"""

from __future__ import annotations

import json
from typing import Any

from attrs import frozen

from llmgw.agent.engines.plan import Preflight, ProcessPlan
from llmgw.model.deployment import ENGINE_PORT_BLOCK
from llmgw.model.engine import EngineSpec

PROBE_ENV = "LLMGW_PREFLIGHT"  # the probe's settings (preflight_probe.ENV)
TAG = "LLMGW_PREFLIGHT"  # the probe's result line (preflight_probe.TAG)
RESULT_FILE = "preflight.json"  # in the engine's folder
GPU_SIZES = (1 << 20, 16 << 20, 256 << 20)
CPU_SIZES = (64 << 10, 1 << 20, 4 << 20)
GPU_ITERS = 5
CPU_ITERS = 3
DEFAULT_TIMEOUT = 60.0
MODES = ("required", "best_effort", "off")
PROBE_MODULE = "llmgw.agent.preflight_probe"  # its file is what runs, not the module


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
                             gang.head_addr, gang.rendezvous_port)
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
    return ProcessPlan("preflight", (python, script), {**env, PROBE_ENV: json.dumps(settings)}, cwd)


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


def parse_output(text: str) -> ProbeResult:
    """The probe's result from its output (the last `LLMGW_PREFLIGHT {json}` line); total:
    anything else is a failed result saying what was wrong, never an exception."""
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
            err = doc.get("error")
            return ProbeResult(False, str(err)[:300] if err else "the probe failed",
                               backend=str(doc.get("backend", ""))[:16])
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
        "results": [{"bytes": r.bytes, "seconds": r.seconds, "algbw_gbps": r.algbw_gbps,
                     "busbw_gbps": r.busbw_gbps} for r in result.results],
    }
