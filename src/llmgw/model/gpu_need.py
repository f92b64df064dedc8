"""The free GPU memory an engine needs before it starts: placement asks for it, the
supervisor checks it again right before spawning.

vLLM refuses to start when a GPU's free memory is below `--gpu-memory-utilization` x
total (its default 0.9; vllm#20305, #25837). SGLang refuses nothing on that ground: it
keeps `1 - --mem-fraction-static` of the memory free at its start for activations and
gives what is left after the weights to its KV pool (0.5.23,
mem_cache/kv_cache_configurator.py `_profile_available_bytes`: free now - free before
the weights x (1 - fraction)), so on a GPU others hold it starts with a smaller pool, or
stops with "Not enough memory" (pool_configurator.py) once the weights do not fit.
llmgw asks the same fraction x total free for SGLang as for vLLM: the pool the
deployment's fraction means, not whatever another process left. A deployment's
`gpu_memory_min` (MiB) raises the floor. Pure: engine args and figures in, MiB out.

vLLM takes that reading after its own CUDA context and, with tensor parallelism, NCCL's
buffers exist (vllm/v1/worker/gpu_worker.py `init_device`: "Initialize the distributed
environment BEFORE taking memory snapshot", then `request_memory` in
vllm/v1/worker/utils.py compares `init_snapshot.free_memory` with utilization x total).
What NVML shows free before the spawn must therefore cover the fraction AND the engine's
own context: CONTEXT_RESERVE. SGLang also takes its "free before the weights" once its
context and NCCL are up (distributed/bootstrap.py `measure_pre_model_load_memory`); the
same reserve is kept for it.
"""

from __future__ import annotations

from llmgw.model.engine import EngineKind

DEFAULT_FRACTION = 0.9

# MiB an engine's own CUDA context (with cuBLAS and NCCL workspaces) takes on each GPU
# before vLLM's free-memory check: about 0.5 GiB for the context with CUDA 12's lazy
# module loading, and NCCL's buffers on top for tensor parallelism; 1 GiB covers both on
# the GPUs llmgw targets. Not yet measured here (no GPU): the figure to confirm the next
# time bench/gpu_check.py runs on one.
CONTEXT_RESERVE = 1024

# The flag each engine sizes its share of a GPU with.
FRACTION_FLAG = {
    EngineKind.VLLM: "--gpu-memory-utilization",
    EngineKind.SGLANG: "--mem-fraction-static",
}


def memory_fraction(engine: EngineKind, args: tuple[str, ...]) -> float:
    """The share of each GPU's total memory `engine` takes with `args` (the last value
    given wins, as argparse does); DEFAULT_FRACTION when unset or unreadable. The
    simulated engine takes none."""
    flag = FRACTION_FLAG.get(engine)
    if flag is None:
        return 0.0 if engine is EngineKind.SIMULATED else DEFAULT_FRACTION
    value = ""
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if engine is EngineKind.VLLM and name.startswith("--"):
            # vLLM's FlexibleArgumentParser takes --gpu_memory_utilization for the dashed
            # flag (utils/argparse_utils.py); SGLang's parser knows only the dashed one.
            name = name.replace("_", "-")
        if name != flag:
            continue
        if eq:
            value = inline
        elif i + 1 < len(args):
            value = args[i + 1]
    try:
        fraction = float(value)
    except ValueError:
        return DEFAULT_FRACTION
    # A fraction outside (0, 1] is the engine's to reject; here it asks for the default.
    return fraction if 0.0 < fraction <= 1.0 else DEFAULT_FRACTION


def memory_need(engine: EngineKind, args: tuple[str, ...], total: int, gpu_memory_min: int = 0) -> int:
    """MiB that must be free on a GPU of `total` MiB for the engine to start there: its
    share and its own CUDA context (CONTEXT_RESERVE), or the floor where that is higher.
    Above `total` the engine cannot start on such a GPU at all (vLLM at utilization 1.0)."""
    fraction = memory_fraction(engine, args)
    if fraction == 0.0:  # the simulated engine takes no GPU memory, context included
        return gpu_memory_min
    return max(gpu_memory_min, int(fraction * total) + CONTEXT_RESERVE)
