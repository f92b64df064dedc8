"""The pre-flight probe: an all-reduce across every GPU of a gang, run by the engine's own
Python with the engine's own environment, before the engine starts.

Standalone on purpose: it imports only the standard library and torch, because it runs
under the vLLM or SGLang interpreter, which has torch and no llmgw. The agent runs it as
`<engine python> preflight_probe.py` with its settings in LLMGW_PREFLIGHT (JSON: nnodes,
node_rank, master_addr, master_port, gpu_sizes, gpu_iters, cpu_sizes, cpu_iters, timeout:
the GPU sizes over NCCL, the CPU ones over Gloo; optional local_ranks); the environment
otherwise is the engine's (CUDA_VISIBLE_DEVICES, NCCL_*, GLOO_SOCKET_IFNAME, UCX_NET_DEVICES).

On each node it starts one process per visible GPU (one on CPU), joins a torch.distributed
group of nnodes x that many ranks over NCCL (GPUs) or Gloo (CPU) at master_addr:port,
checks that an all-reduce sums correctly, then times all-reduces of each size.

A single-node replica's probe is given local_ranks, its GPU count: on GPUs torch must see
exactly that many (else CUDA_VISIBLE_DEVICES is not the replica's: a failure); on CPU
(simulated GPUs) that many Gloo ranks run on this node, so the world is its GPUs. Bus
bandwidth as nccl-tests computes it: algbw = size / time, busbw = algbw x 2(n-1)/n, the
figure comparable with the links' rate whatever n is. Local rank 0 prints one line:
`LLMGW_PREFLIGHT {"ok": true, "backend": ..., "world": n, "results": [{"bytes", "seconds",
"algbw_gbps", "busbw_gbps"}, ...]}` (GB/s as nccl-tests prints them, 1e9 bytes), or with
"ok": false and "error" (the first rank's to fail: the others could only wait out the
timeout for it). The exit code is 0 only when every rank passed.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

ENV = "LLMGW_PREFLIGHT"
TAG = "LLMGW_PREFLIGHT"


def _say(doc: dict[str, Any]) -> None:
    print(f"{TAG} {json.dumps(doc, sort_keys=True)}", flush=True)


def _worker(local_rank: int, per_node: int, gpu: bool, cfg: dict[str, Any], out: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    backend = "nccl" if gpu else "gloo"
    rank = int(cfg["node_rank"]) * per_node + local_rank
    world = int(cfg["nnodes"]) * per_node
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    try:
        if gpu:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend, init_method=f"tcp://{cfg['master_addr']}:{cfg['master_port']}",
            rank=rank, world_size=world, timeout=timedelta(seconds=float(cfg["timeout"])),
        )
        # Correctness first: each rank adds rank + 1, so the sum is world(world + 1)/2.
        probe = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(probe)
        want = world * (world + 1) / 2
        if not torch.all(probe == want):
            raise RuntimeError(f"all-reduce returned {probe[0].item()}, expected {want}")
        results = []
        sizes, iters = (cfg["gpu_sizes"], cfg["gpu_iters"]) if gpu else (cfg["cpu_sizes"], cfg["cpu_iters"])
        for size in sizes:
            n = max(1, int(size) // 4)
            buf = torch.ones(n, dtype=torch.float32, device=device)
            dist.all_reduce(buf)  # warm-up: connections and buffers set up outside the timing
            if gpu:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(int(iters)):
                dist.all_reduce(buf)
            if gpu:
                torch.cuda.synchronize()
            took = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            if gpu:
                took = took.to(device)
            # The slowest rank's time: a collective is as fast as its slowest member.
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            seconds = float(took.item())
            algbw = n * 4 / seconds / 1e9 if seconds > 0 else 0.0
            busbw = algbw * 2 * (world - 1) / world
            results.append({"bytes": n * 4, "seconds": seconds, "algbw_gbps": algbw,
                            "busbw_gbps": busbw})
        dist.destroy_process_group()
        doc = {"ok": True, "backend": backend, "world": world, "rank": rank, "results": results}
    except Exception as exc:  # every failure is the probe's answer, never a traceback alone
        traceback.print_exc(file=sys.stderr)
        doc = {"ok": False, "backend": backend, "world": world, "rank": rank,
               "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if out is not None:
        out.put(doc)
    return doc


def main() -> int:
    try:
        cfg = json.loads(os.environ[ENV])
    except (KeyError, ValueError) as exc:
        _say({"ok": False, "error": f"no usable {ENV}: {exc}"})
        return 2
    started = time.monotonic()
    try:
        import torch
    except ImportError as exc:
        _say({"ok": False, "error": f"torch is not importable by {sys.executable}: {exc}"})
        return 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = int(cfg.get("local_ranks") or 0)
    if gpus and want and gpus != want:
        _say({"ok": False, "backend": "nccl", "error": f"torch sees {gpus} GPU{'s' if gpus > 1 else ''} "
              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}), "
              f"the replica has {want}", "seconds": time.monotonic() - started})
        return 1
    local = gpus or want or 1
    if local == 1:
        doc = _worker(0, 1, gpus > 0, cfg, None)
        doc["seconds"] = time.monotonic() - started
        _say(doc)
        return 0 if doc["ok"] else 1
    import multiprocessing as mp

    # CUDA cannot be forked into; on CPU a fork of this process (torch imported, no op run
    # yet) starts a rank without importing torch again: seconds less on a small machine.
    ctx: Any = mp.get_context("spawn" if gpus else "fork")  # a context of either kind
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, local, gpus > 0, cfg, q)) for i in range(local)]
    for p in procs:
        p.start()
    docs: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    until = time.monotonic() + float(cfg["timeout"]) + 30
    while len(docs) < len(procs) and not bad:
        try:
            doc = q.get(timeout=1.0)
        except queue.Empty:
            # A rank that died before its answer (killed, a crash outside _worker's try)
            # says nothing: the others would wait for it until the timeout.
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > until:
                why = (f"a rank exited with code {dead[0]} before its result" if dead
                       else f"{len(procs) - len(docs)} ranks said nothing")
                bad.append({"ok": False, "backend": "nccl" if gpus else "gloo", "world": local,
                            "rank": -1, "error": why})
            continue
        docs.append(doc)
        if not doc["ok"]:
            # The first failure is the answer: the other ranks could only wait out the
            # timeout for it (rank 0 that could not bind the port, say), and the launcher's
            # bound would end them with "timed out" in place of the cause.
            bad.append(doc)
    for p in procs:
        if bad and p.is_alive():
            p.kill()
        p.join()
    doc = bad[0] if bad else min(docs, key=lambda d: d["rank"])
    doc["seconds"] = time.monotonic() - started
    _say(doc)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
