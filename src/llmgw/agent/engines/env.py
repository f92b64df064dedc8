"""The environment llmgw gives every engine process, and the deployment's env over it."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.config.agent import AgentConfig
from llmgw.errors import EngineError
from llmgw.model.engine import EngineKind, EngineSpec

# The placed GPUs' UUIDs, in CUDA_VISIBLE_DEVICES order, for whoever reads the engine's
# environment or log (nothing in llmgw parses it back): the indices alone do not say which
# physical GPU was meant once the node's numbering changes.
GPU_UUIDS_ENV = "LLMGW_GPU_UUIDS"


def gpu_index_list(spec: EngineSpec, gpu_indices: Mapping[str, int]) -> tuple[int, ...]:
    """The NVML indices of the spec's GPUs, in the order the spec lists them.

    `gpu_indices` maps UUID -> NVML index as read on this node right before the spawn.
    A placed GPU it lacks (fell off the bus, reset, a node that changed since placement)
    refuses the start rather than giving the engine some other GPU.
    """
    out: list[int] = []
    for uuid in spec.gpus:
        index = gpu_indices.get(uuid)
        if index is None:
            listed = ", ".join(sorted(gpu_indices)) or "none"
            raise EngineError(
                f"GPU {uuid} is not on this node now: replica {spec.replica_id} was placed "
                f"on it, and NVML lists {listed}"
            )
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise EngineError(f"GPU {uuid} has no usable NVML index ({index!r})")
        if index in out:
            raise EngineError(f"GPU {uuid} has NVML index {index}, as another GPU of {spec.replica_id}")
        out.append(index)
    return tuple(out)


def default_env(spec: EngineSpec, config: AgentConfig, indices: tuple[int, ...]) -> dict[str, str]:
    """The variables llmgw sets for an engine, before the deployment's own env.

    `indices` are the spec's GPUs as NVML indices (gpu_index_list).
    """
    env = {
        # Number GPUs by PCI bus id, as nvidia-smi and NVML do, never "fastest first": with
        # it, CUDA's device N is NVML's index N.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        # Integers, never UUIDs: vLLM's and SGLang's custom all-reduce and P2P checks parse
        # this variable with int() (vLLM's Platform.device_control_id_to_physical_device_id
        # outside its CUDA platform, older vLLM everywhere, SGLang's copy), and vLLM names
        # its P2P cache file after the value verbatim (eight UUIDs pass 255 bytes). The
        # UUID -> index map is read on the node right before the spawn, so the indices name
        # the GPUs that were placed. No GPUs: "" hides every GPU (CUDA then enumerates
        # none), where leaving it unset would show the engine all of them.
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in indices),
        GPU_UUIDS_ENV: ",".join(spec.gpus),
    }
    if config.mgmt_interface:
        # Bootstrap rides the management network, never a fabric address, a docker bridge
        # or loopback ("Gloo connectFullMesh failed"). Set on one node too: torch's Gloo
        # group for tensor parallel > 1 otherwise binds the hostname's address, often
        # 127.0.1.1 on Debian/Ubuntu. NCCL takes prefixes ("eth" matches eth10) unless the
        # list starts with "="; Gloo takes exact names only (gloo's tcp device strcmp()s
        # each name of the comma list torch splits it into), so no "=" there.
        env["NCCL_SOCKET_IFNAME"] = "=" + config.mgmt_interface
        env["GLOO_SOCKET_IFNAME"] = config.mgmt_interface
    if spec.engine is EngineKind.VLLM and spec.port_base:
        # vLLM's get_open_port() starts here and walks up to the next free port: from this
        # engine's own reserved block rather than from a random one that an engine starting
        # beside it may take first (vllm#43206, #39015). Ray's workers on this node inherit it.
        env["VLLM_PORT"] = str(spec.port_base)
    gang = spec.gang
    if gang is not None and gang.nnodes > 1:
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
