"""`llmgw dev`: server, one agent and the router in one process, like `nomad agent -dev`.

Keys, configs and state live in a scratch folder (removed on exit) or `--state-dir` (kept
and reused). CURVE is on as always: dev makes its own keys. The agent reports simulated
GPUs unless `--real-gpus` finds real ones, and the demo deployment runs the simulated
engine. Unlike the real agent, whose engines outlive it, dev stops its engines before it
exits: Ctrl-C (or SIGTERM) stops the engines through the supervisor, then everything
else; a second Ctrl-C forces it, and whatever engine is still alive then is killed by pid.
The folder (options, keys, ports, config files) is dev_config.py's; this module runs it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from llmgw.agent.process.procs import REPLICA_ENV, try_reap
from llmgw.agent.run import Agent
from llmgw.config.agent import AgentConfig
from llmgw.config.deployment import parse_deployment
from llmgw.config.load_agent import load_agent_config
from llmgw.config.load_router import load_router_config
from llmgw.config.load_server import load_server_config
from llmgw.dev_config import (
    ENGINE_STOP_TIMEOUT,
    DevFiles,
    DevOptions,
    _say,
    check_options,
    free_port,
    write_configs,
)
from llmgw.errors import LlmgwError, UsageError
from llmgw.http1.client import get
from llmgw.model.inventory import GpuSource
from llmgw.router.service import serve_router
from llmgw.router.tenants.sources import tenant_sources
from llmgw.server.peers.service import serve_server
from llmgw.transport.client import request
from llmgw.transport.requests import ApplyOp, EndpointsOp, GetOp, GetWhat, LoadReportOp, Op

log = logging.getLogger(__name__)

# conf/deployments/demo.yaml, here so that dev reads no file (tests/unit/test_examples.py
# checks that the two agree).
DEMO: dict[str, Any] = {
    "name": "demo",
    "model": "llmgw/sim-tiny",
    "engine": "simulated",
    "gpus_per_node": 1,
    "replicas": 2,
    "startup_timeout": "1m",
}
READY_TIMEOUT = 120.0  # how long to wait for the demo before saying it is late
SETTLE = 0.5  # seconds between the engines' stop and the server's
# Engines inherit this (with the dev folder) so that leftovers can be found by pid.
DEV_ROOT_ENV = "LLMGW_DEV_ROOT"


# ---- engines: stopped before dev exits ----


async def stop_engines(agent: Agent, root: Path) -> None:
    """Stop every engine through the agent; return when that is done or no engine process
    of this run is left, whichever comes first (the caller bounds the wait)."""
    async with trio.open_nursery() as nursery:

        async def stop_all() -> None:
            await agent.stop_engines()
            nursery.cancel_scope.cancel()

        nursery.start_soon(stop_all)
        while True:
            await trio.sleep(0.1)
            if not engine_pids(root):  # a process gone is an engine stopped
                break
        nursery.cancel_scope.cancel()


def engine_pids(root: Path) -> list[int]:
    """Live engine processes (tagged LLMGW_REPLICA_ID) started by the dev run in `root`."""
    mark = f"{DEV_ROOT_ENV}={root}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone, or not ours to read
        if state in (b"Z", b"X"):
            try_reap(int(name))
            continue
        if mark in env and any(e.startswith(REPLICA_ENV.encode() + b"=") for e in env):
            found.append(int(name))
    return found


def kill_leftovers(root: Path, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, engines of this dev run that are still alive. Blocking."""
    pids = engine_pids(root)
    if not pids:
        return
    log.warning("engines still running: %s; stopping them", pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                log.debug("pid %d already gone", pid)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = engine_pids(root)
        if not pids:
            return
    log.error("engines that would not die: %s", pids)


# ---- the demo ----


async def wait_for_demo(files: DevFiles, admin: Callable[..., Any], router: tuple[str, int]) -> bool:
    """Wait until the demo's replicas are ready and the router serves its model."""
    name, model = DEMO["name"], DEMO["model"]
    last = ""
    with trio.move_on_after(READY_TIMEOUT):
        while True:
            try:
                rows = await admin(GetOp(GetWhat.DEPLOYMENTS))
            except LlmgwError as exc:
                log.debug("get deployments: %s", exc)
                rows = []
            row = next((r for r in rows if r.get("name") == name), None)
            if row is not None:
                now = f"{name}: {row['ready']}/{row['replicas']} replicas ready ({row['status']})"
                if now != last:
                    _say(now)
                    last = now
                if row["ready"] >= row["replicas"]:
                    break
            await trio.sleep(0.5)
        while True:
            status, body = await get(router[0], router[1], "/v1/models", timeout=2.0)
            if status == 200 and model.encode() in body:
                return True
            await trio.sleep(0.2)
    _say(f"{name} is not ready after {READY_TIMEOUT:g}s; see: "
         + files.ctl_line("describe", "deployment", name))
    return False


async def bring_up(files: DevFiles, opts: DevOptions, router: tuple[str, int]) -> None:
    """Apply the demo (unless --no-demo), wait for it, then print how to use it all."""

    async def admin(op: Op) -> Any:
        return await request(files.server_address, str(files.admin_key), str(files.server_key), op, 5.0)

    url = f"http://{router[0]}:{router[1]}"
    if opts.demo:
        await admin(ApplyOp(parse_deployment(DEMO, "llmgw dev (demo)"), "llmgw dev (demo)"))
        _say(f"applied the demo deployment: {DEMO['replicas']} replicas of {DEMO['model']}")
        await wait_for_demo(files, admin, router)
    body = json.dumps({"model": DEMO["model"], "messages": [{"role": "user", "content": "Hello!"}]})
    lines = [
        "",
        "llmgw dev is up.",
        f"  router: {url}",
        f"  status: http://{files.server_metrics}/  (metrics: /metrics; the agent's: "
        f"http://{files.agent_metrics}/metrics)",
    ]
    if opts.demo:
        lines.append(f"  try:    curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'"
                     f" -d '{body}'")
    else:
        lines.append("  deploy: " + files.ctl_line("apply", "-f", "DEPLOYMENT.yaml"))
    lines += [
        "  ctl:    " + files.ctl_line("status"),
        f"  state:  {files.root}"
        + (" (kept)" if opts.state_dir else " (removed on exit; --state-dir DIR keeps it)"),
        "Ctrl-C stops everything, engines included.",
        "",
    ]
    _say("\n".join(lines))


def _engine_line(name: str, flag: str, given: str, default: str) -> str:
    """Which program serves `name` deployments, checked, in words."""
    if given:
        return f"{name} deployments run {os.path.abspath(given)} ({flag})"
    found = shutil.which(default)
    if found is None:
        return f"{name} deployments would run `{default}`, which is not on PATH ({flag} names one)"
    return f"{name} deployments run {found} (from PATH; {flag} names another)"


def describe_setup(agent: Agent, opts: DevOptions) -> str:
    inv = agent.inventory
    if inv.gpu_source is GpuSource.SIMULATED:
        why = "this machine has none" if opts.real_gpus else "--real-gpus uses this machine's"
        gpus = f"{len(inv.gpus)} simulated GPUs ({why})"
    else:
        gpus = f"{len(inv.gpus)} GPUs ({inv.gpu_source})"
    first = f"llmgw dev: {gpus}"
    if opts.demo:
        first += "; the demo deployment is served by the simulated engine (python -m llmgw.simengine)"
    lines = [first]
    lines.append("  " + _engine_line("vLLM", "--vllm-bin", opts.vllm_bin, "vllm"))
    sglang = opts.sglang_python or ""
    lines.append("  " + _engine_line("SGLang", "--sglang-python", sglang, "python3")
                 + ("" if sglang else "; it needs sglang installed"))
    return "\n".join(lines)


# ---- the run ----


async def _serve_all(opts: DevOptions, files: DevFiles, signals: AsyncIterator[int]) -> None:
    server_cfg = load_server_config(str(files.server_toml))
    agent_cfg: AgentConfig = load_agent_config(str(files.agent_yaml))
    router_cfg = load_router_config(str(files.router_toml))
    stop = trio.Event()

    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            async for signum in signals:
                name = signal.Signals(signum).name
                if stop.is_set():
                    _say(f"{name} again: stopping now")
                    nursery.cancel_scope.cancel()
                    return
                _say(f"{name}: stopping the engines, then everything (again to force)")
                stop.set()

        nursery.start_soon(watch)
        bound = await nursery.start(serve_server, server_cfg)
        log.info("dev server on %s", bound)
        agent = Agent(agent_cfg)
        await nursery.start(agent.serve)
        _say(describe_setup(agent, opts))

        async def table(since: int) -> Mapping[str, Any] | None:
            result = await request(router_cfg.server[0], router_cfg.keys.secret_key,
                                   router_cfg.keys.server_key, EndpointsOp(since), 2.0)
            return result if isinstance(result, Mapping) else None

        async def load_sink(op: LoadReportOp) -> object:  # elastic deployments' load reports
            return await request(router_cfg.server[0], router_cfg.keys.secret_key,
                                 router_cfg.keys.server_key, op, 2.0)

        try:
            router = await nursery.start(functools.partial(serve_router, router_cfg, table_source=table,
                                                           load_sink=load_sink,
                                                           **tenant_sources(router_cfg, request)))
        except OSError as exc:
            raise LlmgwError(f"the router cannot listen on {router_cfg.bind}: {exc}") from None
        nursery.start_soon(bring_up, files, opts, router)
        await stop.wait()
        with trio.move_on_after(ENGINE_STOP_TIMEOUT + 5) as scope:
            await stop_engines(agent, files.root)
        if scope.cancelled_caught:
            log.warning("engines did not stop within %gs", ENGINE_STOP_TIMEOUT + 5)
        # Let the server record the engines' exits (kept with --state-dir) before it stops.
        await trio.sleep(SETTLE)
        nursery.cancel_scope.cancel()


def make_root(state_dir: str | None) -> Path:
    if not state_dir:
        return Path(tempfile.mkdtemp(prefix="llmgw-dev-"))
    root = Path(state_dir).resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--state-dir {state_dir}: {exc}") from None
    return root


async def run_dev(opts: DevOptions) -> None:
    """`llmgw dev` until SIGINT or SIGTERM; returns when everything has stopped."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        check_options(opts)
        router_port = opts.router_port or free_port()
        if opts.router_port == 0:
            _say(f"router port: {router_port} (a free port)")
        root = make_root(opts.state_dir)
        before = os.environ.get(DEV_ROOT_ENV)
        os.environ[DEV_ROOT_ENV] = str(root)  # engines inherit it: leftovers are found by it
        try:
            files = write_configs(root, opts, router_port)
            await _serve_all(opts, files, signals)
        finally:
            kill_leftovers(root)  # blocking, and never skipped by a cancellation
            if before is None:
                os.environ.pop(DEV_ROOT_ENV, None)
            else:
                os.environ[DEV_ROOT_ENV] = before
            if not opts.state_dir:
                try:
                    shutil.rmtree(root)
                except OSError as exc:
                    log.warning("could not remove %s: %s", root, exc)
    _say("llmgw dev: stopped")
