"""The environment llmgw gives every engine process, and the deployment's env over it."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.config.agent import AgentConfig
from llmgw.model.engine import EngineSpec


def default_env(spec: EngineSpec, config: AgentConfig) -> dict[str, str]:
    """The variables llmgw sets for an engine, before the deployment's own env."""
    env = {
        # Number GPUs by PCI bus id, as nvidia-smi and NVML do, never "fastest first".
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        # GPU UUIDs, not indices: CUDA accepts "GPU-<uuid>" entries, and a UUID names the
        # same physical GPU whatever the enumeration order (CUDA_DEVICE_ORDER, a GPU that
        # fell off the bus, MIG reconfiguration), so the engine gets exactly what was placed.
        "CUDA_VISIBLE_DEVICES": ",".join(spec.gpus),
    }
    gang = spec.gang
    if gang is not None and gang.nnodes > 1:
        if config.mgmt_interface:
            # Bootstrap rides the management network, never a fabric address, a docker
            # bridge or loopback ("Gloo connectFullMesh failed").
            env["NCCL_SOCKET_IFNAME"] = config.mgmt_interface
            env["GLOO_SOCKET_IFNAME"] = config.mgmt_interface
        if gang.hcas:
            # A leading "=" makes the names exact: "mlx5_1" alone also matches mlx5_10.
            env["NCCL_IB_HCA"] = "=" + ",".join(gang.hcas)
        # Ray and vLLM must pick the same address on a multi-homed node.
        env["VLLM_HOST_IP"] = config.mgmt_addr
    return env


def merge_env(
    defaults: Mapping[str, str], deployment: Mapping[str, str]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """The deployment's env over llmgw's defaults, and the keys where it changed one."""
    merged = {**defaults, **deployment}
    overridden = tuple(sorted(k for k, v in deployment.items() if k in defaults and defaults[k] != v))
    return merged, overridden
