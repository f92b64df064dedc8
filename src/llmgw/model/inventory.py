"""What a node has: GPUs with NVLink peers, InfiniBand HCAs and fabrics, model storage.

Memory figures are MiB, as nvidia-smi reports them and NVML is converted to.
"""

from __future__ import annotations

import enum

from attrs import field, frozen


@frozen
class Gpu:
    index: int
    uuid: str
    name: str
    memory_total: int  # MiB
    memory_free: int  # MiB
    pci_bus_id: str  # canonical form, e.g. "00000000:18:00.0"
    numa_node: int | None = None
    compute_capability: str = ""  # e.g. "9.0"
    # Peer GPU UUID -> number of NVLink links between the two.
    nvlink_peers: dict[str, int] = field(factory=dict)


class GpuSource(enum.StrEnum):
    NVML = "nvml"
    NVIDIA_SMI = "nvidia-smi"
    NONE = "none"
    SKIPPED = "skipped"
    SIMULATED = "simulated"


@frozen
class IbPort:
    number: int
    state: str  # e.g. "ACTIVE", "DOWN", "INIT" (the word after "N: " in sysfs)
    phys_state: str  # e.g. "LinkUp", "Disabled", "Polling"
    rate_gbps: float
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    subnet_prefix: str  # first 64 bits of GID 0, e.g. "fe80:0000:0000:0000"

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"


@frozen
class Hca:
    name: str  # e.g. "mlx5_0"
    node_guid: str
    ports: tuple[IbPort, ...] = ()


class FabricState(enum.StrEnum):
    UP = "up"  # every port of every labelled HCA active
    DEGRADED = "degraded"  # some ports down
    DOWN = "down"  # all ports down: not eligible for multi-node replicas


@frozen
class FabricReport:
    """A fabric as configured on this node, with the state its HCAs are in."""

    name: str
    hcas: tuple[str, ...]
    state: FabricState
    rate_gbps: float = 0.0  # as configured


@frozen
class ModelCopy:
    """One copy of a model's weights that this node can see."""

    name: str  # "org/name" id (or the directory name when there is no org)
    path: str
    size: int  # bytes
    complete: bool
    reason: str = ""  # why it is incomplete; empty when complete
    shared: bool = False
    # Shared: the filer's identity (mount source, or an operator-given store name), the
    # same on every node that mounts it. Local: empty.
    store: str = ""


@frozen
class StorageReport:
    """`asked` false: `model_dirs` unset; ranks exactly like asked-and-found-nothing."""

    asked: bool = False
    models: tuple[ModelCopy, ...] = ()

    def holds(self, model: str) -> bool:
        """True when a complete copy of `model` (an id or a path) is visible here."""
        return any(m.complete and (m.name == model or m.path == model) for m in self.models)


@frozen
class EngineAvailability:
    """Whether this node can start one engine kind: its binary or python resolves.

    `kind` is an EngineKind value, kept a plain string so that a kind this peer does not
    know still decodes. `key` is the agent config key that names the command.
    """

    kind: str
    available: bool
    key: str = ""  # e.g. "engines.vllm.bin"
    command: str = ""  # as configured, e.g. "vllm"
    path: str = ""  # what it resolved to
    version: str = ""  # where cheap to tell (package metadata); "" when unknown
    reason: str = ""  # why not available, e.g. "vllm not found"


@frozen
class Inventory:
    gpus: tuple[Gpu, ...] = ()
    gpu_source: GpuSource = GpuSource.NONE
    hcas: tuple[Hca, ...] = ()
    fabrics: tuple[FabricReport, ...] = ()
    unlabelled_hcas: tuple[str, ...] = ()
    storage: StorageReport = StorageReport()
    warnings: tuple[str, ...] = ()
    # Per engine kind, whether it can start here. Empty (an older agent): not reported,
    # which placement takes as available.
    engines: tuple[EngineAvailability, ...] = ()

    def lacked_engine(self, kind: str) -> EngineAvailability | None:
        """The report saying `kind` cannot start here; None when it can or is not reported."""
        for e in self.engines:
            if e.kind == kind and not e.available:
                return e
        return None


@frozen
class NodeInfo:
    """What an agent says about itself besides its inventory (from its configuration)."""

    node_id: str
    mgmt_addr: str
    mgmt_interface: str = ""
    labels: dict[str, str] = field(factory=dict)
    # Inclusive range the server draws engine HTTP, rendezvous and Ray ports from.
    port_range: tuple[int, int] = (20000, 29999)
