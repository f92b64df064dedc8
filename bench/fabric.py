"""Fabric figures (issue 22), on this machine, with real llmgw processes on loopback.

    .venv/bin/python bench/fabric.py --vllm-venv .ci-vllm-venv --runs 3

1. The pre-flight's cost: a two-node replica (simulated engine, two agents, fake HCAs and
   simulated GPUs) from `ctl apply` to ready, with `preflight: required` (llmgw's probe,
   Gloo on CPU, run by the vLLM CPU environment's Python) and with `preflight: off`,
   interleaved; the difference is what the pre-flight adds. Aim: at most 10 s.
2. A bad HCA: from writing DOWN into a member's HCA port (sysfs, the agent's default
   hca_interval of 2 s) to its replacement ready and the old replica gone, with drain
   off (drain_timeout 0s) so that only llmgw's own reaction is timed. Aim: at most 10 s.

Prints one line per run and the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _cluster(root: Path, venv: Path | None) -> tuple[Any, Any]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from fakes.live import Cluster  # type: ignore[import-not-found]
    from fakes.sysfs import add_hca  # type: ignore[import-not-found]

    c = Cluster(root, heartbeat="1s", lost_after="60s")
    c.start_server()
    for name in ("a1", "a2"):
        ib = root / "ib" / name
        add_hca(ib, "mlx5_0")
        add_hca(ib, "mlx5_1")
        kw: dict[str, Any] = {"discovery": {"ib_root": str(ib), "simulated_gpus": 4},
                              "fabrics": [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}]}
        if venv is not None:
            kw["engines"] = {"preflight_python": str(venv.resolve() / "bin" / "python")}
        c.start_agent(name, **kw)
    c.wait_states({"a1": "ready", "a2": "ready"})
    return c, add_hca


def _replicas(c: Any) -> dict[str, dict[str, Any]]:
    r = c.ctl("get", "replicas", "-o", "json")
    return {x["id"]: x for x in json.loads(r.stdout)} if r.returncode == 0 else {}


def _wait(cond: Any, timeout: float, c: Any = None) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            if c is not None:
                print(c.ctl("get", "replicas").stdout, flush=True)
            raise SystemExit(f"timed out after {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def _gang(root: Path, name: str, preflight: str) -> Path:
    f = root / f"{name}.yaml"
    f.write_text(f"name: {name}\nmodel: org/{name}\nengine: simulated\ngpus_per_node: 1\n"
                 f"nodes: 2\nreplicas: 1\ndrain_timeout: 0s\npreflight: {preflight}\n")
    return f


def preflight_cost(c: Any, root: Path, runs: int) -> dict[str, float]:
    on, off = [], []
    for i in range(runs):
        for mode, out in (("required", on), ("off", off)):
            name = f"p{i}-{mode.replace('_', '')}"
            t0 = time.monotonic()
            assert c.ctl("apply", "-f", str(_gang(root, name, mode))).returncode == 0
            _wait(lambda n=name: _replicas(c).get(f"{n}-0", {}).get("state") == "ready", 120, c)
            out.append(time.monotonic() - t0)
            print(f"preflight {mode:8}: ready {out[-1]:.2f}s after apply", flush=True)
            assert c.ctl("delete", "deployment", name).returncode == 0
            _wait(lambda n=name: f"{n}-0" not in _replicas(c), 60)
    return {"ready_with_preflight_s": statistics.median(on), "ready_without_s": statistics.median(off),
            "preflight_adds_s": statistics.median(on) - statistics.median(off)}


def hca_move(c: Any, root: Path, runs: int) -> dict[str, float]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from fakes.sysfs import PHYS, STATES  # type: ignore[import-not-found]

    def set_port(node: str, hca: str, state: str) -> None:
        port = root / "ib" / node / hca / "ports" / "1"
        (port / "state").write_text(STATES[state] + "\n")
        (port / "phys_state").write_text(PHYS[state] + "\n")

    took = []
    assert c.ctl("apply", "-f", str(_gang(root, "h", "off"))).returncode == 0
    _wait(lambda: any(v["state"] == "ready" for v in _replicas(c).values()), 60)
    for i in range(runs):
        # The replacement rides the other HCA on a2: take that one down next time.
        hca = f"mlx5_{i % 2}"
        (before,) = [k for k, v in _replicas(c).items() if k.startswith("h-")]
        set_port("a2", hca, "DOWN")
        t = _wait(lambda b=before: (lambda r: b not in r and any(
            v["state"] == "ready" for v in r.values()))(_replicas(c)), 60)
        took.append(t)
        print(f"HCA {hca} DOWN -> {before} replaced and stopped: {t:.2f}s", flush=True)
        set_port("a2", hca, "ACTIVE")
        time.sleep(35)  # the default hca_quiet (30 s) before it counts again
    return {"hca_down_to_moved_s": statistics.median(took), "hca_down_to_moved_max_s": max(took)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", type=Path, help="a Python environment with torch (the probe)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=("preflight", "hca"), default=None)
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    a = ap.parse_args()
    out: dict[str, float] = {}
    tmp = tempfile.mkdtemp(prefix="llmgw-fabric-")
    try:
        root = Path(tmp)
        c, _ = _cluster(root, a.vllm_venv)
        try:
            if a.only in (None, "preflight"):
                if a.vllm_venv is None:
                    print("no --vllm-venv: the pre-flight cost is not measured", flush=True)
                else:
                    out |= preflight_cost(c, root, a.runs)
            if a.only in (None, "hca"):
                out |= hca_move(c, root, a.runs)
        finally:
            c.close()
    finally:
        if a.keep:
            print(f"kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: round(v, 2) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
