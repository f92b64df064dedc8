"""Running a launch plan (llmgw.agent.engines) in one new session.

A plan of one process is spawned directly. A plan of several (a Ray head, then
`vllm serve`) runs through llmgw.agent.insession.launcher, which starts the earlier processes as
its children in the same session, waits for the Ray cluster when the plan says so, then
execs the main process: every process shares one session whose id is the recorded pid.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping

from llmgw.agent.discovery.engine_check import find_python, resolve
from llmgw.agent.engines import LaunchPlan, ProcessPlan, build_plan, weights_for
from llmgw.agent.engines.keys import sglang_key_config, with_key
from llmgw.agent.engines.preflight import settings_of
from llmgw.agent.insession import preflight_probe
from llmgw.agent.process import procs
from llmgw.config.agent import AgentConfig
from llmgw.model.affinity import GpuHca, for_member
from llmgw.model.engine import EngineKind, EngineSpec
from llmgw.model.inventory import Inventory, StorageReport

# (spec, GPU UUID -> NVML index read on the node right before the spawn) -> the plan.
# Raises EngineError when a placed GPU is not in the map (the supervisor refuses the start).
PlanFn = Callable[[EngineSpec, Mapping[str, int]], LaunchPlan]


# This node's last storage scan (Inventory.storage); called on the event loop, so it must
# not block (the agent hands over `lambda: self.inventory.storage`).
StorageFn = Callable[[], StorageReport]


# This node's last inventory, for each gang member's GPU -> HCA map; called on the event
# loop, so it must not block.
InventoryFn = Callable[[], Inventory]


def default_plan(config: AgentConfig, python: str, storage: StorageFn | None = None,
                 inventory: InventoryFn | None = None) -> PlanFn:
    """Plans as build_plan makes them. With `storage`, the engine loads the copy the scan
    found, or downloads into download_dir (weights_for); without it, the model as written.
    With `inventory`, a gang member's GPUs each get their nearest HCA of the fabric."""

    def plan(spec: EngineSpec, gpu_indices: Mapping[str, int]) -> LaunchPlan:
        weights = weights_for(spec, config, storage()) if storage is not None else None
        nics: tuple[GpuHca, ...] = ()
        version = ""
        if inventory is not None:
            inv = inventory()
            version = next((e.version for e in inv.engines if e.kind == spec.engine.value), "")
            if spec.gang is not None and spec.gang.hcas:
                nics = for_member(inv.gpus, inv.hcas, spec.gpus, spec.gang.hcas)
        probe = probe_command(spec, config, python) if settings_of(spec) else ("", "")
        # Every engine the agent starts requires its own API key (engine keys), given at spawn.
        return with_key(build_plan(spec, config, config.supervisor.work_dir, python=python,
                                   gpu_indices=gpu_indices, weights=weights, nics=nics,
                                   probe=probe, engine_version=version), spec)

    return plan


def interpreter_of(path: str) -> str:
    """The Python that runs `path` (itself, or the console script's #! Python, followed
    through `#!/usr/bin/env python3` and pip's /bin/sh trampoline); "" when none is found
    (a required pre-flight is then refused: engines/preflight.preflight_for)."""
    return find_python(path)[0]


def probe_command(spec: EngineSpec, config: AgentConfig, python: str) -> tuple[str, str]:
    """(interpreter, script) of the pre-flight probe for `spec`: the engine's own Python
    (it has torch; the agent's need not), unless engines.preflight_python names one;
    llmgw's probe unless engines.preflight_probe names another. A vLLM whose binary does
    not resolve gives "" here, and the start fails on the binary as it would without."""
    eng = config.engines
    interpreter = eng.preflight_python
    if not interpreter:
        if spec.engine is EngineKind.VLLM:
            interpreter = interpreter_of(resolve(eng.vllm.bin)[0])
        elif spec.engine is EngineKind.SGLANG:
            interpreter = eng.sglang.python
        else:
            interpreter = eng.simulated_python or python
    return interpreter, eng.preflight_probe or preflight_probe.__file__


def write_secret(path: str, text: str) -> None:
    """`text` to `path`, readable by this user only (0600), atomically."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a leftover temporary file keeps its old mode otherwise
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def spawn_plan(plan: LaunchPlan, folder: str, log_path: str, tag: str, api_key: str = "") -> int:
    """Spawn `plan` in one new session, every process tagged LLMGW_REPLICA_ID=tag.

    `api_key` (the engine's own, from its record) goes where the plan says
    (engines/keys.py): into the main process's `api_key_env`, and into `api_key_file`."""
    base = dict(os.environ)
    secret: dict[str, str] = {}
    if api_key and plan.api_key_env:
        secret[plan.api_key_env] = api_key
    if api_key and plan.api_key_file:
        write_secret(plan.api_key_file, sglang_key_config(api_key))

    def env_of(p: ProcessPlan) -> dict[str, str]:
        # The key only for the main process (the one serving HTTP): a Ray head or a probe
        # has no use for it. It wins over a deployment's own value of the variable.
        return {**base, **p.env, **(secret if p is plan.main else {}), procs.REPLICA_ENV: tag}

    main = plan.main
    if len(plan.processes) == 1 and not plan.wait_for_ray_nodes and plan.preflight is None:
        return procs.spawn(main.argv, env=env_of(main), cwd=main.cwd or None, log_path=log_path)
    doc = {
        "pre": [{"name": p.name, "argv": list(p.argv), "env": env_of(p), "cwd": p.cwd}
                for p in plan.processes[:-1]],
        "main": {"name": main.name, "argv": list(main.argv), "env": env_of(main),
                 "cwd": main.cwd},
        "wait_for_ray_nodes": plan.wait_for_ray_nodes,
        "ray_status_argv": list(plan.ray_status_argv),
    }
    pre = plan.preflight
    if pre is not None:
        doc["preflight"] = {"name": pre.process.name, "argv": list(pre.process.argv),
                            "env": env_of(pre.process), "cwd": pre.process.cwd,
                            "timeout": pre.timeout, "required": pre.required,
                            "min_busbw_gbps": pre.min_busbw_gbps, "result": pre.result_path,
                            "nccl_floor_gbps": pre.nccl_floor_gbps}
    # 0600: the environments in it hold the engine's key.
    path = os.path.join(folder, "plan.json")
    write_secret(path, json.dumps(doc))
    argv = (sys.executable, "-m", "llmgw.agent.insession.launcher", path)
    return procs.spawn(argv, env=env_of(main), cwd=None, log_path=log_path)
