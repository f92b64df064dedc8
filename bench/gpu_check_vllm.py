#!/usr/bin/env python3
"""A torch stand-in for `vllm` (`vllm serve ...`), for bench/gpu_check.py on a GPU machine
that has PyTorch with CUDA but no vLLM. `engines.vllm.bin` names a wrapper that execs it.

What it does, in vLLM's order, each with vLLM's own rule and words (vLLM 0.32's code):

1. vLLM's argv: `serve MODEL --host --port --served-model-name --tensor-parallel-size
   --pipeline-parallel-size --gpu-memory-utilization --enable-sleep-mode ...`; flags it
   does not use are printed as a note, never an error.
2. CUDA_VISIBLE_DEVICES as vLLM maps a visible device to a physical one for its custom
   all-reduce and P2P checks (platforms/interface.py visible_device_id_to_physical_device_id
   -> device_control_id_to_physical_device_id: int() of each comma-separated entry; a
   non-integer is "Non-integer device ID '...' is not supported by cuda."; vLLM's CUDA
   platform alone falls back to an NVML UUID lookup, older releases did list(map(int, ...))).
3. Each visible device's UUID (torch.cuda.get_device_properties(i).uuid) against
   LLMGW_GPU_UUIDS, which the agent sets in CUDA_VISIBLE_DEVICES order
   (llmgw/agent/engines/env.py): the device CUDA gives is the GPU llmgw placed.
4. vLLM's free-memory rule after the CUDA context exists (v1/worker/utils.py
   request_memory): requested = ceil(total x gpu_memory_utilization); free below that is
   "Free memory on device cuda:0 (F/T GiB) on startup is less than desired GPU memory
   utilization (U, R GiB). Decrease GPU memory utilization or reduce GPU memory used by
   other processes." and exit 1.
5. Holds the memory with torch: the requested amount less what this process holds
   already (its CUDA context), as vLLM's KV cache fills its budget.
6. Knobs (environment): LLMGW_STANDIN_LOAD_SECONDS "loads" that long, a progress line a
   second; LLMGW_STANDIN_STALL=silent never serves and prints nothing more;
   LLMGW_STANDIN_STALL=broadcast never serves and prints vLLM's shm_broadcast line
   ("No available shared memory broadcast block found in 60 seconds ...") every
   LLMGW_STANDIN_STALL_EVERY seconds (2), as a deadlocked first forward does.
7. Serves through llmgw's simulated engine (llmgw.simengine, same argv), whose /sleep
   and /wake_up here also free and take back the held memory (torch.cuda.empty_cache: the
   CUDA context stays, as vLLM's does).

Without CUDA (the suite), LLMGW_STANDIN_FAKE_CUDA=<fake NVML state file> runs the same
logic against bench/gpu_check_fake_nvml: the GPUs, UUIDs and free memory that fake
reports, and "holding" memory writes <state>.holds/<pid>.json, which that fake adds to
its process list for as long as this pid lives.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
FAKE_ENV = "LLMGW_STANDIN_FAKE_CUDA"
LOAD_ENV = "LLMGW_STANDIN_LOAD_SECONDS"
STALL_ENV = "LLMGW_STANDIN_STALL"
STALL_EVERY_ENV = "LLMGW_STANDIN_STALL_EVERY"
UUIDS_ENV = "LLMGW_GPU_UUIDS"  # llmgw.agent.engines.env.GPU_UUIDS_ENV
DEFAULT_UTILIZATION = 0.9  # vLLM's CacheConfig default
# vLLM's shm_broadcast.LONG_WAIT_TIME_LOG_MSG, as it logs it with 60 seconds.
BROADCAST_LINE = ("No available shared memory broadcast block found in 60 seconds. This "
                  "typically happens when some processes are hanging or doing some "
                  "time-consuming work (e.g. compilation, weight/kv cache quantization).")
# A fake CUDA context: what a real one costs on an H100 with torch, about.
FAKE_CONTEXT_MIB = 512


class Refused(Exception):
    """What vLLM would die of, in its words."""


# -- pure: argv, CUDA_VISIBLE_DEVICES, UUIDs, the memory rule -------------------------


def parse_serve(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """`serve MODEL ...` as vLLM takes it: the flags llmgw passes, and the rest (unknown)."""
    args = list(argv)
    if not args or args[0] != "serve":
        raise Refused(f"this stand-in runs `vllm serve MODEL ...` only, got {' '.join(args)!r}")
    p = argparse.ArgumentParser(prog="vllm serve", add_help=False, allow_abbrev=False)
    p.add_argument("model", nargs="?")
    p.add_argument("--model", dest="model_flag")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_UTILIZATION)
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--headless", action="store_true")
    ns, unknown = p.parse_known_args(args[1:])
    ns.model = ns.model or ns.model_flag
    if not ns.model:
        raise Refused("vllm serve: no model given")
    if not 0 < ns.gpu_memory_utilization <= 1:
        raise Refused(f"GPU memory utilization must be within (0, 1]. Got "
                      f"{ns.gpu_memory_utilization}.")
    return ns, unknown


def visible_devices(value: str | None) -> list[int] | None:
    """CUDA_VISIBLE_DEVICES as physical ids, each entry int() as vLLM's
    device_control_id_to_physical_device_id does; None when unset or empty."""
    if not value:
        return None
    out = []
    for entry in value.split(","):
        try:
            out.append(int(entry))
        except ValueError:
            raise Refused(f"Non-integer device ID {entry!r} is not supported by cuda.") from None
    return out


def uuid_problem(torch_uuids: Sequence[str], env_uuids: str | None) -> str:
    """"" when the devices CUDA gives are LLMGW_GPU_UUIDS, in order; else what differs.
    torch prints UUIDs without NVML's "GPU-" prefix: compared without it."""
    if env_uuids is None:
        return f"{UUIDS_ENV} is not set (the agent sets it beside CUDA_VISIBLE_DEVICES)"
    want = [u.strip() for u in env_uuids.split(",") if u.strip()]

    def bare(u: str) -> str:
        return u.lower().removeprefix("gpu-")

    if [bare(u) for u in torch_uuids] != [bare(u) for u in want]:
        return f"CUDA's devices are {list(torch_uuids)}, {UUIDS_ENV} says {want}"
    return ""


def format_gib(b: int) -> str:
    return f"{round(b / GIB, 2)}"  # vllm/utils/mem_utils.py format_gib


def request_memory(free: int, total: int, utilization: float, device: str = "cuda:0") -> int:
    """vLLM's rule (v1/worker/utils.py request_memory): the bytes it asks for, or Refused
    with vLLM's text when less is free after its CUDA context exists."""
    requested = math.ceil(total * utilization)
    if free < requested:
        raise Refused(
            f"Free memory on device {device} ({format_gib(free)}/{format_gib(total)} GiB) on "
            f"startup is less than desired GPU memory utilization ({utilization}, "
            f"{format_gib(requested)} GiB). Decrease GPU memory utilization or reduce GPU "
            f"memory used by other processes.")
    return requested


# -- the devices: torch's CUDA, or the fake NVML's state --------------------------------


class TorchCuda:
    """The GPUs CUDA shows this process, through torch."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise Refused("torch sees no CUDA device (and LLMGW_STANDIN_FAKE_CUDA is not set)")
        self.torch = torch
        self.held: list[Any] = []

    def count(self) -> int:
        return int(self.torch.cuda.device_count())

    def uuid(self, i: int) -> str:
        return str(self.torch.cuda.get_device_properties(i).uuid)

    def init(self, i: int) -> None:
        self.torch.cuda.set_device(i)
        self.torch.zeros(1, device=f"cuda:{i}")  # the CUDA context, as vLLM's worker makes it

    def mem(self, i: int) -> tuple[int, int]:
        free, total = self.torch.cuda.mem_get_info(i)
        return int(free), int(total)

    def own_use(self, i: int) -> int:
        """What this process holds on device i (NVML: its context too); 0 when unknown."""
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + self.uuid(i).removeprefix("GPU-"))
            return sum(int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                       if p.pid == os.getpid())
        except Exception as exc:  # nvidia-ml-py absent or NVML refuses: count nothing of ours
            print(f"stand-in: own memory not read through NVML ({exc})", flush=True)
            return 0

    def hold(self, i: int, nbytes: int) -> None:
        if nbytes > 0:
            self.held.append(self.torch.empty(nbytes, dtype=self.torch.uint8, device=f"cuda:{i}"))
            self.torch.cuda.synchronize(i)

    def release(self) -> None:
        self.held.clear()
        self.torch.cuda.empty_cache()


class FakeCuda:
    """The fake NVML's GPUs (bench/gpu_check_fake_nvml), shown through
    CUDA_VISIBLE_DEVICES as CUDA would: device i is NVML index visible[i]."""

    def __init__(self, state: str, visible: list[int] | None) -> None:
        os.environ["LLMGW_FAKE_NVML"] = state
        path = Path(__file__).resolve().parent / "gpu_check_fake_nvml" / "pynvml.py"
        spec = importlib.util.spec_from_file_location("standin_fake_pynvml", path)
        assert spec is not None and spec.loader is not None
        self.nvml = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.nvml)
        total = int(self.nvml.nvmlDeviceGetCount())
        self.visible = visible if visible is not None else list(range(total))
        for v in self.visible:
            if not 0 <= v < total:
                # What CUDA does with an index past the GPUs: no device at all.
                raise Refused(f"CUDA_VISIBLE_DEVICES names device {v}; there are {total}")
        self.holds: dict[int, int] = {}
        self.file = self.nvml.holds_dir(state) / f"{os.getpid()}.json"

    def count(self) -> int:
        return len(self.visible)

    def uuid(self, i: int) -> str:
        return str(self.nvml.nvmlDeviceGetUUID(self.nvml.nvmlDeviceGetHandleByIndex(self.visible[i])))

    def _write(self) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(self.visible[i]): mib for i, mib in self.holds.items()}))
        os.replace(tmp, self.file)

    def init(self, i: int) -> None:
        if i not in self.holds:
            self.holds[i] = FAKE_CONTEXT_MIB
            self._write()

    def mem(self, i: int) -> tuple[int, int]:
        info = self.nvml.nvmlDeviceGetMemoryInfo(self.nvml.nvmlDeviceGetHandleByIndex(self.visible[i]))
        return int(info.free), int(info.total)

    def own_use(self, i: int) -> int:
        return self.holds.get(i, 0) * MIB

    def hold(self, i: int, nbytes: int) -> None:
        self.holds[i] = self.holds.get(i, 0) + max(0, nbytes) // MIB
        self._write()

    def release(self) -> None:
        self.holds = {i: FAKE_CONTEXT_MIB for i in self.holds}  # the context stays
        self._write()


# -- the process -------------------------------------------------------------------------


def say(text: str) -> None:
    print(f"stand-in[{os.getpid()}]: {text}", flush=True)


def take_memory(dev: Any, utilization: float) -> dict[int, int]:
    """vLLM's rule on every visible device, then the budget held: bytes requested per device."""
    requested = {}
    for i in range(dev.count()):
        dev.init(i)
        free, total = dev.mem(i)
        requested[i] = request_memory(free, total, utilization, f"cuda:{i}")
    hold_budget(dev, requested)
    return requested


def hold_budget(dev: Any, requested: Mapping[int, int]) -> None:
    for i, want in requested.items():
        dev.hold(i, want - dev.own_use(i))


def stall(mode: str, env: Mapping[str, str]) -> None:
    """Never serve: as a silent hang, or a deadlocked first forward that logs vLLM's line."""
    every = float(env.get(STALL_EVERY_ENV, "2") or 2)
    say(f"stalling ({mode}): never serving")
    while True:
        time.sleep(every)
        if mode == "broadcast":
            print(f"WARNING {time.strftime('%m-%d %H:%M:%S')} [shm_broadcast.py:566] {BROADCAST_LINE}",
                  flush=True)


def patch_sleep(dev: Any, requested: Mapping[int, int]) -> None:
    """The simulated engine's /sleep frees the held memory and /wake_up takes it back
    (vLLM's cumem allocator frees weights and KV cache; the CUDA context stays)."""
    from llmgw.simengine import api

    sleep, wake = api.SimEngine._sleep, api.SimEngine._wake_up

    async def _sleep(self: Any, ex: Any) -> None:
        # Freed before /sleep answers, as vLLM's worker frees before it replies: whoever
        # reads NVML after the answer sees the memory back.
        level = api._query(ex.target).get("level", "1")
        freeing = self.args.sleep_mode and not self.asleep and level in ("1", "2")
        if freeing:
            dev.release()
        try:
            await sleep(self, ex)
        except BaseException:
            if freeing and not self.asleep:
                hold_budget(dev, requested)  # refused after all: holding again
            raise
        if freeing:
            say("asleep: memory released")

    async def _wake_up(self: Any, ex: Any) -> None:
        if self.asleep:
            hold_budget(dev, requested)
            say("awake: memory held again")
        await wake(self, ex)

    api.SimEngine._sleep = _sleep
    api.SimEngine._wake_up = _wake_up


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    say(f"TORCH STAND-IN for vllm (bench/gpu_check_vllm.py): {' '.join(argv)}")
    try:
        ns, unknown = parse_serve(argv)
        if unknown:
            say(f"flags this stand-in does not use (ignored): {' '.join(unknown)}")
        visible = visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
        fake = env.get(FAKE_ENV, "")
        dev: Any = FakeCuda(fake, visible) if fake else TorchCuda()
        world = ns.tensor_parallel_size * ns.pipeline_parallel_size
        if world > dev.count():
            raise Refused(f"world size {world} (tensor x pipeline parallel) is larger than the "
                          f"{dev.count()} GPUs CUDA shows (CUDA_VISIBLE_DEVICES="
                          f"{env.get('CUDA_VISIBLE_DEVICES')!r})")
        uuids = [dev.uuid(i) for i in range(dev.count())]
        problem = uuid_problem(uuids, env.get(UUIDS_ENV))
        if problem:
            raise Refused(problem)
        say(f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r} -> physical {visible}, "
            f"UUIDs {uuids} match {UUIDS_ENV}")
        requested = take_memory(dev, ns.gpu_memory_utilization)
        say(f"holding {', '.join(f'cuda:{i} {format_gib(b)} GiB' for i, b in requested.items())} "
            f"(utilization {ns.gpu_memory_utilization})")
    except Refused as exc:
        print(f"ValueError: {exc}", file=sys.stderr, flush=True)
        return 1
    load = float(env.get(LOAD_ENV, "0") or 0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < load:
        time.sleep(min(1.0, load))
        say(f"loading weights: {min(100, int(100 * (time.monotonic() - t0) / load))}%")
    mode = env.get(STALL_ENV, "")
    if mode in ("silent", "broadcast"):
        stall(mode, env)
    patch_sleep(dev, requested)
    from llmgw.simengine.server import main as serve

    # The simulated engine's knobs stay off: this process has "loaded" already.
    return serve(argv, {k: v for k, v in env.items() if k != "LLMGW_SIM_LOAD_SECONDS"})


if __name__ == "__main__":
    sys.exit(main())
