"""The free GPU memory an engine needs before it starts: placement asks for it, the
supervisor checks it again right before spawning.

vLLM refuses to start when a GPU's free memory is below `--gpu-memory-utilization` x
total (its default 0.9; vllm#20305, #25837); SGLang sizes its pools from
`--mem-fraction-static` of the total in the same way. A deployment's `gpu_memory_min`
(MiB) raises the floor. Pure: engine args and figures in, MiB out.
"""

from __future__ import annotations

from llmgw.model.engine import EngineKind

DEFAULT_FRACTION = 0.9

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
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    try:
        fraction = float(value)
    except ValueError:
        return DEFAULT_FRACTION
    # A fraction outside (0, 1] is the engine's to reject; here it asks for the default.
    return fraction if 0.0 < fraction <= 1.0 else DEFAULT_FRACTION


def memory_need(engine: EngineKind, args: tuple[str, ...], total: int, gpu_memory_min: int = 0) -> int:
    """MiB that must be free on a GPU of `total` MiB for the engine to start there."""
    return max(gpu_memory_min, int(memory_fraction(engine, args) * total))
