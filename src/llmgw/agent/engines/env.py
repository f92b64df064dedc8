"""The environment llmgw gives every engine process, and the deployment's env over it."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.config.agent import AgentConfig
from llmgw.config.vllm_serve import data_parallel_size
from llmgw.errors import EngineError
from llmgw.model.affinity import GpuHca
from llmgw.model.engine import EngineKind, EngineSpec

# The placed GPUs' UUIDs, in CUDA_VISIBLE_DEVICES order, for whoever reads the engine's
# environment or log (nothing in llmgw parses it back): the indices alone do not say which
# physical GPU was meant once the node's numbering changes.
GPU_UUIDS_ENV = "LLMGW_GPU_UUIDS"

# The first vLLM whose port search terminates with VLLM_PORT set and data parallelism on.
# Before it, `vllm serve --data-parallel-size N` with VLLM_PORT could hang at start with
# no output: get_open_ports_list looped forever once VLLM_PORT was taken (vllm#36191),
# and get_open_port spun on a VLLM_PORT inside the DP master's reserved window of ten
# ports (vllm#50024, reproduced on 0.26.0; fixed by #50965, first released in 0.28.0).
# 0.32's network_utils.py (the real-engine tier's) rescans past the window.
VLLM_PORT_DP_SAFE = (0, 28)


def release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "0.32.0+cpu" -> (0, 32, 0); "" -> ()."""
    out: list[int] = []
    for part in version.split("+", 1)[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):  # "0rc1": the number, then stop
            break
    return tuple(out)


def vllm_port_hangs(args: tuple[str, ...], version: str) -> bool:
    """Whether VLLM_PORT would hang this vLLM's start: data parallelism asked for on a
    version before VLLM_PORT_DP_SAFE, or on a version the agent could not read."""
    if data_parallel_size(args) <= 1:
        return False
    found = release(version)
    return not found or found < VLLM_PORT_DP_SAFE


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


def default_env(spec: EngineSpec, config: AgentConfig, indices: tuple[int, ...],
                nics: tuple[GpuHca, ...] = (), engine_version: str = "") -> dict[str, str]:
    """The variables llmgw sets for an engine, before the deployment's own env.

    `indices` are the spec's GPUs as NVML indices (gpu_index_list). `nics`: each placed
    GPU's nearest HCA of the gang's fabric (llmgw.model.affinity.for_member); () where
    the node could not tell, and no GPU -> NIC map is set. `engine_version`: the engine's
    version as the agent's engine check read it ("" unknown).
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
    if spec.engine is EngineKind.VLLM and spec.port_base and not vllm_port_hangs(
            spec.args, engine_version):
        # vLLM's get_open_port() starts here and walks up to the next free port: from this
        # engine's own reserved block rather than from a random one that an engine starting
        # beside it may take first (vllm#43206, #39015). Ray's workers on this node inherit it.
        env["VLLM_PORT"] = str(spec.port_base)
    gang = spec.gang
    if gang is not None and gang.nnodes > 1:
        if gang.hcas:
            # A leading "=" makes the names exact: "mlx5_1" alone also matches mlx5_10.
            env["NCCL_IB_HCA"] = "=" + ",".join(gang.hcas)
        env.update(nic_env(spec, config, nics))
        # Ray and vLLM must pick the same address on a multi-homed node.
        env["VLLM_HOST_IP"] = config.mgmt_addr
    return env


# vLLM's own GPU -> NIC map (vllm/v1/executor/vllm_net_devices.py, read by every worker of
# its multiproc and uniproc executors, not by Ray's): "GPU_BDF=NIC_BDF,..." and the
# variables each worker sets from its GPU's NIC, "VAR[:suffix]" (the suffix is appended
# to the RDMA device name). Both or neither: vLLM refuses one without the other.
VLLM_NIC_MAP_ENV = "VLLM_GPU_NIC_PCIE_MAPPING"
VLLM_NIC_VARS_ENV = "VLLM_NIC_SELECTION_VARS"


def nic_env(spec: EngineSpec, config: AgentConfig, nics: tuple[GpuHca, ...]) -> dict[str, str]:
    """The GPU -> HCA map for what picks its own NIC (UCX, so NIXL's KV transfers).

    NCCL needs none: given NCCL_IB_HCA it pairs each GPU with its nearest HCA from the
    same PCIe tree itself. UCX does not: unset, UCX_NET_DEVICES is "all", and a UCX
    endpoint on an HCA across the CPU is the "HTTP 200 with garbage" of dynamo#12463.
    vLLM with its multiproc executor sets UCX_NET_DEVICES per worker to that worker's
    GPU's HCA (VLLM_GPU_NIC_PCIE_MAPPING); it prepends to a value already set, so llmgw
    sets none there. Everything else (SGLang, Ray workers, one process for several GPUs)
    gets the placed GPUs' HCAs, each once, as `mlx5_0:1` (UCX names device:port).
    """
    if not nics:
        return {}
    ports = {n.port for n in nics}
    per_worker = (
        spec.engine is EngineKind.VLLM
        and config.engines.vllm.launch_mode == "mp"
        and all(n.gpu_bus_id and n.hca_bus_id for n in nics)
        and len(ports) == 1
    )
    if per_worker:
        return {
            VLLM_NIC_MAP_ENV: ",".join(f"{n.gpu_bus_id.lower()}={n.hca_bus_id}" for n in nics),
            # Only UCX's variable: vLLM writes "<dev><suffix>,<what was set>", which for
            # NCCL_IB_HCA would drop the "=" that makes the names exact.
            VLLM_NIC_VARS_ENV: f"UCX_NET_DEVICES:{ports.pop()}",
        }
    return {"UCX_NET_DEVICES": ",".join(dict.fromkeys(f"{n.hca}:{n.port}" for n in nics))}


def merge_env(
    defaults: Mapping[str, str], deployment: Mapping[str, str]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """The deployment's env over llmgw's defaults, and the keys where it changed one."""
    merged = {**defaults, **deployment}
    overridden = tuple(sorted(k for k, v in deployment.items() if k in defaults and defaults[k] != v))
    return merged, overridden
