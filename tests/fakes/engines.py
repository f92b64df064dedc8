"""Helpers for tests that run the simulated engine as a real process on 127.0.0.1.

port = free_port()
with SimEngineProcess.start(["serve", "m", "--host", "127.0.0.1", "--port", str(port)],
                            env={"LLMGW_SIM_LOAD_SECONDS": "0.2"}) as eng:
    eng.wait_healthy()              # or: await eng.wait_healthy_async()
    ...
# leaving the block kills the process (by pid) and reaps it
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import trio

SIMENGINE = [sys.executable, "-m", "llmgw.simengine"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (bind to 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def vllm_args(port: int, name: str = "sim", model: str = "org/sim-model") -> list[str]:
    """The vLLM-shaped argv llmgw emits for one node, on 127.0.0.1."""
    return [
        "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", name, "--tensor-parallel-size", "1",
    ]  # fmt: skip


def health_status(host: str, port: int, timeout: float = 1.0) -> int | None:
    """The status of GET /health, or None when the connection is refused or times out."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


class SimEngineProcess:
    """One simulated engine subprocess, killed by pid when the test is done."""

    def __init__(self, proc: subprocess.Popen[bytes], host: str, port: int, log: Path) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self.log_path = log

    @classmethod
    def start(
        cls,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        log_dir: Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> SimEngineProcess:
        """Start `python -m llmgw.simengine ARGS` with stderr/stdout to a log file.

        `port` defaults to the value of `--port` in args.
        """
        args = list(args)
        if port is None and "--port" in args:
            port = int(args[args.index("--port") + 1])
        full_env = dict(os.environ)
        full_env.update(env or {})
        log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        log = log_dir / f"simengine-{port}-{time.monotonic_ns()}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen([*SIMENGINE, *args], stdout=out, stderr=subprocess.STDOUT, env=full_env)
        return cls(proc, host, port or 0, log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> int | None:
        return health_status(self.host, self.port)

    def wait_healthy(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"simengine exited {self.proc.returncode}:\n{self.log_text()}")
            if self.health() == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"simengine not healthy after {timeout}s:\n{self.log_text()}")

    async def wait_healthy_async(self, timeout: float = 10.0) -> None:
        with trio.fail_after(timeout):
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"simengine exited {self.proc.returncode}:\n{self.log_text()}")
                status = await trio.to_thread.run_sync(health_status, self.host, self.port, 0.5)
                if status == 200:
                    return
                await trio.sleep(0.05)

    def wait_exit(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """SIGKILL by pid and reap (no-op when it already exited)."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited between poll and kill: nothing to clean up
            self.proc.wait(10)

    def __enter__(self) -> SimEngineProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
