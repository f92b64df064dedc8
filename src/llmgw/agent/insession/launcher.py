"""Runs a multi-process launch plan inside one session: `python -m llmgw.agent.insession.launcher PLAN`.

The supervisor spawns this in a new session (output already going to engine.log). It
starts the plan's earlier processes (e.g. `ray start --head --block`) as its children,
in the same session; when the plan asks, waits until the Ray cluster counts enough alive
nodes (no deadline of its own: the supervisor's startup timeout bounds it); then replaces
itself with the main process, so the recorded pid is the engine's own.

PLAN is the JSON file the supervisor wrote (see llmgw.agent.process.spawn.spawn_plan).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from llmgw.agent.engines import count_ray_nodes
from llmgw.agent.engines.ray import CLIENT_SERVER_FLAG, without_client_server_port
from llmgw.agent.insession import preflight_run
from llmgw.model.preflight import EXIT_CODE as PREFLIGHT_EXIT

POLL = 1.0


def _say(text: str) -> None:
    print(f"llmgw launcher: {text}", flush=True)


def _ray_nodes(argv: list[str], env: dict[str, str]) -> int:
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _say(f"ray status failed: {exc}")
        return 0
    return count_ray_nodes(done.stdout)


def _interpreter(script: str) -> list[str]:
    """The Python that runs the console script `script` (from its #! line), or []."""
    path = shutil.which(script)
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            first = f.readline(1024)
    except OSError:
        return []
    if not first.startswith(b"#!"):
        return []
    words = first[2:].decode(errors="replace").split()
    if words and "python" in os.path.basename(words[-1]):
        return words
    return []


def _ray_has_client(ray_bin: str, env: dict[str, str]) -> bool:
    """Whether `ray_bin`'s Python can import grpc (ray[client]); True when unsure."""
    python = _interpreter(ray_bin)
    if not python:
        return True
    try:
        done = subprocess.run([*python, "-c", "import grpc"], env=env, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return done.returncode == 0


def _ray_start_argv(argv: list[str], env: dict[str, str]) -> list[str]:
    if any(a.startswith(CLIENT_SERVER_FLAG) for a in argv) and not _ray_has_client(argv[0], env):
        _say(f"{argv[0]} has no ray[client] (grpcio): no Ray Client server runs, so the head "
             f"starts without {CLIENT_SERVER_FLAG.rstrip('=')}")  # fmt: skip
        return list(without_client_server_port(tuple(argv)))
    return argv


def _wait_ray(plan: dict[str, Any]) -> None:
    want = int(plan["wait_for_ray_nodes"])
    argv = list(plan["ray_status_argv"])
    env = plan["main"]["env"]
    last = -1
    while True:
        have = _ray_nodes(argv, env) if argv else 0
        if have != last:
            _say(f"Ray cluster counts {have} of {want} nodes")
            last = have
        if have >= want:
            return
        time.sleep(POLL)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m llmgw.agent.insession.launcher PLAN.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        plan = json.load(f)
    # The collective pre-flight (a gang member's, or a single-node tensor-parallel
    # replica's), before anything of the engine runs.
    if plan.get("preflight") and not preflight_run.run(plan["preflight"]):
        return PREFLIGHT_EXIT
    children = []  # kept: they live on in the main process once it execs
    for proc in plan["pre"]:
        pre_argv = _ray_start_argv(list(proc["argv"]), proc["env"])
        _say(f"starting {proc['name']}: {' '.join(pre_argv)}")
        children.append(subprocess.Popen(pre_argv, env=proc["env"], cwd=proc["cwd"] or None))
    if plan.get("wait_for_ray_nodes"):
        _wait_ray(plan)
    main_proc = plan["main"]
    if main_proc["cwd"]:
        os.chdir(main_proc["cwd"])
    _say(f"exec {main_proc['name']}: {' '.join(main_proc['argv'])}")
    os.execvpe(main_proc["argv"][0], main_proc["argv"], main_proc["env"])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
