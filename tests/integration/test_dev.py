"""`llmgw dev`: the whole system in one process; serves through the router, stops cleanly.

Engines run in their own sessions, so the test finds them by pid (their environment
carries LLMGW_REPLICA_ID and the dev folder) and makes sure none is left behind.
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
from tests.fakes.engines import free_port

from llmgw.agent.discovery.gpus import read_gpus
from llmgw.config.agent import DiscoveryConfig
from llmgw.dev import DEV_ROOT_ENV
from llmgw.model.inventory import GpuSource

LLMGW = [sys.executable, "-m", "llmgw.cli"]


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != os.getpid()]


def dev_engines(state: Path) -> list[int]:
    """Live engine processes of the dev run whose folder is `state`."""
    mark = f"{DEV_ROOT_ENV}={state}".encode()
    return [
        pid for pid in _pids()
        if _alive(pid) and mark in (env := _environ(pid))
        and any(e.startswith(b"LLMGW_REPLICA_ID=") for e in env)
    ]


def _ours(root: Path) -> list[int]:
    """Processes started under `root` (cwd below it, or its path in their environment)."""
    found = []
    for pid in _pids():
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        if cwd.startswith(str(root)) or any(str(root).encode() in e for e in _environ(pid)):
            found.append(pid)
    return found


def _kill_by_pid(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def _reader(stream: object, lines: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line.rstrip("\n"))


def _wait_line(lines: queue.Queue[str], seen: list[str], prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        seen.append(line)
        if line.strip().startswith(prefix):
            return line.strip()[len(prefix):].strip()
    raise AssertionError(f"no {prefix!r} line within {timeout}s; stdout so far:\n" + "\n".join(seen))


class _Dev:
    """`llmgw dev ARGS` in `cwd`, its stdout read line by line on a thread, its stderr in
    dev.stderr there."""

    def __init__(self, cwd: Path, *args: str) -> None:
        self.log = cwd / "dev.stderr"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [*LLMGW, "dev", *args],
                stdout=subprocess.PIPE, stderr=err, text=True, cwd=cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=_reader, args=(self.proc.stdout, self.lines), daemon=True)
        self.reader.start()

    def wait_line(self, prefix: str, timeout: float) -> str:
        return _wait_line(self.lines, self.seen, prefix, timeout)

    def close(self) -> None:
        """Killed if still running, its reader joined, its stdout closed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.reader.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _engine_port_base() -> int:
    while True:
        base = free_port()
        if base <= 64000:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
            return base


def test_dev_serves_a_chat_completion_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    state = (tmp_path / "state").resolve()
    router_port = free_port()
    dev = _Dev(tmp_path, "--router-port", str(router_port), "--state-dir", str(state),
               "--port-base", str(_engine_port_base()))
    proc, log, seen = dev.proc, dev.log, dev.seen
    try:
        try:
            url = dev.wait_line("router:", 120)
            curl = dev.wait_line("try:", 5)
            ctl = dev.wait_line("ctl:", 5)
        except AssertionError:
            raise AssertionError(log.read_text(errors="replace")) from None
        assert url == f"http://127.0.0.1:{router_port}"
        assert any("simulated GPUs" in s and "simulated engine" in s for s in seen), seen
        assert curl.startswith(f"curl -s {url}/v1/chat/completions") and "llmgw/sim-tiny" in curl
        assert ctl == f"llmgw ctl --config {state / 'ctl.toml'} status"
        # The printed ctl line works as printed (its settings all come from ctl.toml).
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        status = subprocess.run([*LLMGW, *shlex.split(ctl)[1:]], capture_output=True, text=True,
                                timeout=30, cwd=tmp_path, env=env)
        assert status.returncode == 0 and "demo" in status.stdout, status.stdout + status.stderr

        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=30) as client:
            reply = client.chat.completions.create(
                model="llmgw/sim-tiny", messages=[{"role": "user", "content": "Hello!"}])
        assert reply.choices[0].message.content

        engines = dev_engines(state)
        assert len(engines) == 2, engines

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text(errors="replace")
        assert not [p for p in engines if _alive(p)], "engines left behind"
        assert dev_engines(state) == []
        dev.wait_line("llmgw dev: stopped", 5)
        # --state-dir keeps the keys for the next run.
        assert (state / "keys" / "dev-admin.key_secret").exists()
    finally:
        dev.close()
        leftovers = _ours(tmp_path)
        _kill_by_pid(leftovers)
        assert not leftovers, f"processes left behind: {leftovers}"


def test_dev_refuses_a_router_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([*LLMGW, "dev", "--router-port", str(port)], capture_output=True,
                           text=True, timeout=30, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"port {port}" in r.stderr and "--router-port" in r.stderr
    assert "Traceback" not in r.stderr


def test_simulated_gpus_stand_in_only_where_no_gpu_source_answers(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-nvidia-smi")
    sim = read_gpus(DiscoveryConfig(nvidia_smi=missing, prefer_nvml=False, simulated_gpus=3),
                    node_id="n1")
    assert sim.source is GpuSource.SIMULATED and sim.warnings == ()
    assert [g.uuid for g in sim.gpus] == ["GPU-sim-n1-0", "GPU-sim-n1-1", "GPU-sim-n1-2"]
    assert all(g.memory_total == 24 * 1024 for g in sim.gpus)
    assert set(sim.gpus[0].nvlink_peers) == {"GPU-sim-n1-1", "GPU-sim-n1-2"}

    none = read_gpus(DiscoveryConfig(nvidia_smi=missing, prefer_nvml=False), node_id="n1")
    assert none.source is GpuSource.NONE and none.gpus == ()
    skipped = read_gpus(DiscoveryConfig(skip_gpus=True, simulated_gpus=2), node_id="n1")
    assert skipped.source is GpuSource.SKIPPED


def test_dev_starts_beside_the_production_metrics_ports_and_prints_the_status_page(
    tmp_path: Path,
) -> None:
    """A server or agent on this machine (or another dev) holds 9464 and 9465: dev picks
    free ports for its own metrics listeners and prints the status page's URL."""
    held = []
    for port in (9464, 9465):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            s.close()  # taken already: the case under test all the same
            continue
        held.append(s)
    dev = _Dev(tmp_path, "--no-demo", "--router-port", "0", "--state-dir",
               str(tmp_path / "state"), "--port-base", str(_engine_port_base()))
    proc = dev.proc
    try:
        try:
            status = dev.wait_line("status:", 60)
        except AssertionError:
            raise AssertionError("\n".join(dev.seen) + "\n" + dev.log.read_text(errors="replace")) from None
        url = status.split()[0]
        host_port = url.removeprefix("http://").rstrip("/")
        assert url.startswith("http://127.0.0.1:") and not host_port.endswith((":9464", ":9465"))
        with socket.create_connection(tuple(host_port.rsplit(":", 1)), timeout=10) as c:  # type: ignore[arg-type]
            c.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert c.recv(100).startswith(b"HTTP/1.1 200 ")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        for s in held:
            s.close()
        dev.close()
        _kill_by_pid(_ours(tmp_path))
