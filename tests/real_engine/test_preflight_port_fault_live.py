"""llmgw's probe under vLLM's CPU environment (torch) with its rendezvous port held by
another process (issue 30 item 4): torch's TCPStore fails with EADDRINUSE, rank 0 says so
at once (not after the other rank waits out the timeout), and the launcher reads it from
the output alone as a port fault carrying that port."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from llmgw.agent.engines.preflight import PORT_FAULT, PROBE_ENV
from llmgw.agent.insession import preflight_probe, preflight_run

pytestmark = pytest.mark.real_engine


def test_a_held_port_is_a_port_fault_read_from_torchs_own_error(tmp_path: Path, vllm_venv: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        settings = {"nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": port,
                    "gpu_sizes": [1 << 20], "gpu_iters": 1, "cpu_sizes": [1 << 16], "cpu_iters": 1,
                    "timeout": 60.0, "local_ranks": 2}
        doc = {"argv": [str(vllm_venv / "bin" / "python"), preflight_probe.__file__],
               "env": {**os.environ, PROBE_ENV: json.dumps(settings)}, "cwd": str(tmp_path),
               "timeout": 60.0, "required": False, "result": str(tmp_path / "preflight.json")}
        t0 = time.monotonic()
        result = preflight_run.probe(doc)
        took = time.monotonic() - t0
    assert not result.ok and result.fault == PORT_FAULT and result.port == port, result
    assert "EADDRINUSE" in result.error
    assert took < 45.0, took  # not the 60 s timeout of the rank left waiting
