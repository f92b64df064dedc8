"""What a node has: GPUs with NVLink peers, InfiniBand HCAs and fabrics, model storage.

Memory figures are MiB, as nvidia-smi reports them and NVML is converted to.
"""

from __future__ import annotations

import enum

from attrs import field, frozen


@frozen
class GpuProcess:
    """A compute process holding memory on a GPU that is not an engine this agent runs
    (a training job, a notebook, an engine left over from before): placement counts its
    memory as taken, and a refused start names it."""

    pid: int
    command: str  # its command line, shortened (NVML's process name where /proc is closed)
    memory: int  # MiB it holds on this GPU; 0: not reported (MIG, older drivers)


# A GPU problem is hard or soft. Hard (the GPU lost or unreadable, its fabric not ready,
# MIG on, a failed row remap, a recovery action NVML asks for, a critical Xid): the GPU is
# never placed and the replicas on it move. Soft (a row remap or page retirement pending a
# reset, volatile uncorrected ECC errors): no new replica is placed there, and what runs
# on it stays; NVIDIA's own words on a pending remap are that unaffected work continues
# and new work may start (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt).
#
# A soft line carries this mark at its start, in the one `problems` tuple, so that the
# wire does not change: a server from before reads it as a problem, which is what it did
# with these lines before (it drains), and this server reads an older agent's lines, which
# carry no mark, as hard, as they were.
SOFT_MARK = "no new work: "


def soft(line: str) -> str:
    """`line` marked soft (no new work here; what runs stays)."""
    return line if line.startswith(SOFT_MARK) else SOFT_MARK + line


def is_soft(line: str) -> bool:
    return line.startswith(SOFT_MARK)


def hard_problems(problems: tuple[str, ...]) -> tuple[str, ...]:
    """The lines of `problems` that move what runs (every unmarked one)."""
    return tuple(p for p in problems if not is_soft(p))


def soft_problems(problems: tuple[str, ...]) -> tuple[str, ...]:
    """The lines of `problems` that only keep new work off, without their mark."""
    return tuple(p.removeprefix(SOFT_MARK) for p in problems if is_soft(p))


@frozen
class Gpu:
    index: int  # NVML's index, which CUDA uses under CUDA_DEVICE_ORDER=PCI_BUS_ID
    uuid: str
    name: str
    memory_total: int  # MiB
    memory_free: int  # MiB
    pci_bus_id: str  # canonical form, e.g. "00000000:18:00.0"
    numa_node: int | None = None
    compute_capability: str = ""  # e.g. "9.0"
    # Peer GPU UUID -> number of NVLink links between the two.
    nvlink_peers: dict[str, int] = field(factory=dict)
    # Why this GPU may not be placed, one line each ("lost: GPU is lost", "MIG mode is
    # on", "NVSwitch fabric not ready (in progress)", "Xid 79 at ...", and soft ones, marked
    # (SOFT_MARK): "no new work: row remap pending ..."); empty: healthy. A replica on a
    # GPU with a hard problem is moved away (replacement first), as a drain moves it; a
    # soft one only keeps new replicas off.
    problems: tuple[str, ...] = ()
    # Compute processes on it that are not engines this agent runs.
    processes: tuple[GpuProcess, ...] = ()
    # Non-empty: an engine stopped here and its memory has not come back yet (the
    # replica id and what is still there); never placed until it has.
    releasing: str = ""
    # PCIe ancestry, host bridge first, the device last, in sysfs names:
    # ("pci0000:17", "0000:17:01.0", "0000:18:00.0", "0000:19:00.0"); empty: unknown.
    pci_path: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        """No hard problem: what runs here may stay."""
        return not self.hard_problems

    @property
    def hard_problems(self) -> tuple[str, ...]:
        return hard_problems(self.problems)

    @property
    def soft_problems(self) -> tuple[str, ...]:
        return soft_problems(self.problems)

    @property
    def placeable(self) -> bool:
        """No problem, hard or soft, and not releasing: placement may give it to a new
        replica."""
        return not self.problems and not self.releasing


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
    # PCIe ancestry as for Gpu.pci_path (the fabric work pairs GPUs with their nearest
    # HCAs by it); empty: unknown.
    pci_path: tuple[str, ...] = ()
    numa_node: int | None = None
    # Why traffic should not ride it now, one line each, from the agent's HCA watch
    # ("port 1 DOWN (Disabled)", "port 1 symbol_error +240 in 2s"); empty: healthy. The
    # server stops counting it in its fabric, and moves the replicas using it, until the
    # port is ACTIVE and its error counters quiet again.
    problems: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        """No problems reported, and an active port where ports are listed."""
        return not self.problems and (not self.ports or any(p.active for p in self.ports))


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


def names_a_path(model: str) -> bool:
    """True when a deployment's `model` is a path, which an engine opens as written,
    rather than a hub id that a copy or a download stands for (the agent's weights, the
    server's placement: one rule for both)."""
    return model.startswith(("/", "./", "../", "~"))


@frozen
class StorageReport:
    """`asked` false: `model_dirs` unset; ranks exactly like asked-and-found-nothing."""

    asked: bool = False
    models: tuple[ModelCopy, ...] = ()
    # Where an engine with no copy here downloads (agent.yaml's download_dir), and the
    # bytes free there (statvfs, for an unprivileged user); -1: not known (no download_dir,
    # unreadable, an agent from before), which placement takes as room enough. The agent
    # reports a change of free space only beyond FREE_SPACE_SLACK (discovery/discover.py).
    download_dir: str = ""
    download_free: int = -1
    # Downloads under way (or cut short) in download_dir: model id -> bytes already on
    # disk there (the hub cache's blobs, the .incomplete ones included). Finishing one
    # takes only the rest, so placement counts these as room of that model's (a second
    # replica on the node shares the download, a restarted one resumes it). Empty: none,
    # or an agent from before, which placement charges the whole size as it did.
    downloading: dict[str, int] = field(factory=dict)

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


@frozen
class NodeInfo:
    """What an agent says about itself besides its inventory (from its configuration)."""

    node_id: str
    mgmt_addr: str
    mgmt_interface: str = ""
    labels: dict[str, str] = field(factory=dict)
    # Inclusive range the server draws engine HTTP, rendezvous and Ray ports from.
    port_range: tuple[int, int] = (20000, 29999)
    # Where routers follow this node's engines' KV-cache events (kv_aware routing):
    # tcp://mgmt_addr:kv_relay_port, the agent's CURVE socket. "": no relay (the port is
    # 0, or an agent from before the relay).
    kv_relay: str = ""
