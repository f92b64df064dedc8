"""Pre-flight that blames the right thing (issue 30 item 4), agent side: a probe that could
not bind its rendezvous port is a port fault (typed, with the port, from the probe's
output alone), and the engine does not start on it whatever the mode; a probe whose NCCL
crossed nodes over TCP sockets on a gang with HCAs fails, read from NCCL's own INFO
lines. Probe doubles print what torch and NCCL print."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from fakes.engines import free_port
from fakes.supervision import Reports
from fakes.supervisor_proc import config
from llmgw.agent.engines.preflight import (
    PORT_FAULT,
    PROBE_ENV,
    SOCKET_FAULT,
    ProbeResult,
    nccl_networks,
    net_verdict,
    parse_output,
    port_fault,
)
from llmgw.agent.insession import preflight_probe, preflight_run
from llmgw.agent.lifecycle.preflight_report import parse_result
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.config.agent import EnginesConfig
from llmgw.model.engine import EngineKind, EngineSpec, EngineState, GangSpec
from llmgw.model.preflight import EXIT_CODE, FAILED_LINE, failure, port_in_use

# torch 2.13's TCPStore, rank 0 binding a port another process holds (DistNetworkError,
# as the probe prints it: f"{type(exc).__name__}: {exc}").
TORCH_IN_USE = ("DistNetworkError: The server socket has failed to listen on any local network "
                "address. port: 29611, useIpv6: false, code: -98, name: EADDRINUSE, message: "
                "address already in use")
GOOD = {"ok": True, "backend": "nccl", "world": 2, "seconds": 3.0, "results": [
    {"bytes": 268435456, "seconds": 0.01, "algbw_gbps": 40.0, "busbw_gbps": 40.0}]}
# NCCL 2.x INFO lines as src/init.cc and src/transport/net.cc print them.
NCCL_IB = """node1:1234:1290 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eno1:10.0.0.2<0>
node1:1234:1290 [0] NCCL INFO Using network IB
node1:1234:1301 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
node1:1234:1301 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0(1)/GDRDMA
"""
NCCL_SOCKET = """node1:1234:1290 [0] NCCL INFO NET/IB : No device found.
node1:1234:1290 [0] NCCL INFO NET/Socket : Using [0]eno1:10.0.0.2<0>
node1:1234:1290 [0] NCCL INFO Using network Socket
node1:1234:1301 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
"""


def line(doc: object) -> str:
    return f"LLMGW_PREFLIGHT {json.dumps(doc)}"


def test_a_taken_rendezvous_port_is_a_port_fault_with_its_port() -> None:
    r = parse_output("Traceback ...\n" + line({"ok": False, "backend": "nccl", "error": TORCH_IN_USE}))
    assert not r.ok and r.fault == PORT_FAULT and r.port == 29611
    assert r.line() == f"failed: rendezvous port 29611 is in use ({TORCH_IN_USE})"
    # Python's own wording, no port in it: the rendezvous port the probe was given.
    r = parse_output(line({"ok": False, "error": "OSError: [Errno 98] Address already in use"}), 29600)
    assert (r.fault, r.port) == (PORT_FAULT, 29600)
    # Anything else is no port fault: the nodes' (or the links') as before.
    for err in ("RuntimeError: Connection refused", "DistStoreError: Timed out after 60 seconds "
                "waiting for clients. 1/2 clients joined. port: 29611"):
        r = parse_output(line({"ok": False, "error": err}), 29600)
        assert not r.ok and r.fault == "" and r.port == 0 and r.error == err


@given(st.text(max_size=400), st.integers(min_value=-5, max_value=70000))
def test_port_fault_is_total_and_in_range(error: str, port: int) -> None:
    got = port_fault(error, port)
    assert got == 0 or 0 < got < 65536
    r = parse_output(line({"ok": False, "error": error}), port)
    assert isinstance(r, ProbeResult) and (r.fault == PORT_FAULT) == (r.port > 0)


def test_ncclS_network_from_its_info_lines() -> None:
    assert nccl_networks(NCCL_IB) == ("IB",)
    assert nccl_networks(NCCL_SOCKET) == ("Socket",)
    assert nccl_networks("x NCCL INFO Using network AWS Libfabric\n... via NET/AWS Libfabric/0/GDRDMA") \
        == ("AWS Libfabric",)
    assert nccl_networks("no NCCL here\n") == ()


@given(st.text(max_size=2000))
def test_nccl_networks_is_total(text: str) -> None:
    assert all(isinstance(n, str) and n for n in nccl_networks(text))


def test_sockets_on_a_gang_with_hcas_fail_the_probe() -> None:
    ok = parse_output(line(GOOD))
    bad = net_verdict(ok, NCCL_SOCKET, ("mlx5_0", "mlx5_1"))
    assert not bad.ok and bad.fault == SOCKET_FAULT
    assert bad.error.startswith("NCCL used TCP sockets (NET/Socket), not the gang's HCAs mlx5_0,mlx5_1")
    assert net_verdict(ok, NCCL_IB, ("mlx5_0",)) == ok
    assert net_verdict(ok, NCCL_SOCKET, ()) == ok  # no HCAs: sockets are all there is
    assert net_verdict(ok, "", ("mlx5_0",)) == ok  # no NCCL lines: nothing to tell
    gloo = parse_output(line({**GOOD, "backend": "gloo"}))
    assert net_verdict(gloo, NCCL_SOCKET, ("mlx5_0",)) == gloo  # Gloo on CPU: never NCCL's


def _doc(tmp_path: Path, out: str, *, required: bool = True, hcas: tuple[str, ...] = ()) -> dict[str, object]:
    probe = tmp_path / "probe.py"
    probe.write_text(f"import sys\nsys.stdout.write({out!r})\n")
    settings: dict[str, object] = {"nnodes": 2, "node_rank": 0, "master_port": 29611}
    if hcas:
        settings["hcas"] = list(hcas)
    return {"argv": [sys.executable, str(probe)], "env": {PROBE_ENV: json.dumps(settings)},
            "cwd": "", "timeout": 20.0, "required": required, "result": str(tmp_path / "preflight.json")}


@pytest.mark.parametrize("required", [True, False])
def test_the_launcher_starts_no_engine_on_a_taken_port_and_says_which(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], required: bool) -> None:
    doc = _doc(tmp_path, line({"ok": False, "backend": "gloo", "error": TORCH_IN_USE}) + "\n",
               required=required)
    assert not preflight_run.run(doc)  # best effort too: the engine would meet on that port
    said = capsys.readouterr().out
    why = f"rendezvous port 29611 is in use ({TORCH_IN_USE})"
    assert f"{FAILED_LINE}{why}\n" in said
    assert "llmgw launcher: pre-flight: port 29611 is taken: the engine does not start" in said
    got = parse_result((tmp_path / "preflight.json").read_text())  # what the agent reports
    assert got.port == 29611 and f"failed: {why}".startswith(got.line)  # at most 200 characters
    # The server reads the same from the exit's log tail.
    assert port_in_use(failure(EXIT_CODE, said.splitlines())) == 29611


def test_the_launcher_fails_a_probe_whose_nccl_used_sockets(tmp_path: Path) -> None:
    sockets = preflight_run.probe(_doc(tmp_path, NCCL_SOCKET + line(GOOD) + "\n", hcas=("mlx5_0",)))
    assert not sockets.ok and sockets.fault == SOCKET_FAULT and sockets.port == 0
    assert preflight_run.probe(_doc(tmp_path, NCCL_IB + line(GOOD) + "\n", hcas=("mlx5_0",))).ok
    got = parse_result(json.dumps({"ok": False, "line": "failed: x", "fault": SOCKET_FAULT, "port": 5}))
    assert got.port == 0  # only a port fault carries a port to the server


def test_the_probe_exits_on_its_first_failed_rank(tmp_path: Path) -> None:
    """Several local ranks: rank 0 failing (a port it cannot bind) is the answer at once,
    not after the others waited out the timeout and the launcher killed them all as
    "timed out"."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import time\nclass _C:\n    @staticmethod\n    def is_available():\n        return False\n"
        "cuda = _C()\ndef device(*args):\n    return args\n")
    (fake / "distributed.py").write_text(
        "import time\nclass ReduceOp:\n    MAX = 'max'\n"
        "def init_process_group(backend, init_method, rank, world_size, timeout):\n"
        "    if rank == 0:\n"
        "        raise RuntimeError('The server socket has failed to listen on any local network "
        "address. port: 29611, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use')\n"
        "    time.sleep(600)\n")
    cfg = {"nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 29611,
           "gpu_sizes": [], "gpu_iters": 1, "cpu_sizes": [], "cpu_iters": 1, "timeout": 300,
           "local_ranks": 2}
    done = subprocess.run([sys.executable, preflight_probe.__file__], capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(tmp_path), PROBE_ENV: json.dumps(cfg)})
    r = parse_output(done.stdout, 29611)
    assert done.returncode == 1 and r.fault == PORT_FAULT and r.port == 29611, done.stdout + done.stderr
    # A rank that dies before its answer (no exception to report) is the answer too.
    (fake / "distributed.py").write_text(
        "import os, time\n"
        "def init_process_group(backend, init_method, rank, world_size, timeout):\n"
        "    if rank == 1:\n"
        "        os._exit(7)\n"
        "    time.sleep(600)\n")
    done = subprocess.run([sys.executable, preflight_probe.__file__], capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(tmp_path), PROBE_ENV: json.dumps(cfg)})
    r = parse_output(done.stdout)
    assert done.returncode == 1 and r.error == "a rank exited with code 7 before its result", done.stdout


async def test_the_agent_reports_the_taken_port_with_the_exit(tmp_path: Path) -> None:
    """The head's launcher exits on a port fault: its exit report names the port as in
    conflict (EngineReport.conflict_port), which the server blocks on this node."""
    port = free_port()
    probe = tmp_path / "probe.py"
    probe.write_text("import json\nprint('LLMGW_PREFLIGHT ' + json.dumps({'ok': False, 'backend': 'gloo', "
                     f"'error': {TORCH_IN_USE.replace('29611', str(port))!r}}}))\n")
    cfg = attrs.evolve(config(str(tmp_path / "work")),
                       engines=EnginesConfig(preflight_python=sys.executable, preflight_probe=str(probe)))
    gang = GangSpec(2, 0, "127.0.0.1", port, preflight="best_effort", preflight_timeout=10.0)
    spec = EngineSpec("g-0", 1, "g", "org/g", "g", EngineKind.SIMULATED, (), free_port(), gang=gang)
    reports = Reports()
    sup = Supervisor(cfg, reports)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        gone = await reports.wait("g-0", EngineState.EXITED, timeout=20)
        nursery.cancel_scope.cancel()
    assert gone.exit_code == EXIT_CODE and gone.conflict_port == port
    assert gone.preflight.startswith(f"failed: rendezvous port {port} is in use (DistNetworkError")
