"""`ctl gpu clear NODE GPU` on the server (GPU health): find the GPU in the node's
inventory (by index or UUID) and send its agent a ClearGpu, which forgets the GPU's Xid
problems. Admin only, as every op that changes a node.

What NVML itself reports (a pending row remap, a recovery action, a lost GPU) is read
again at every discovery and is not the operator's to clear: the answer says which of the
GPU's problems the command clears (its Xids) and which stay.
"""

from __future__ import annotations

from typing import Any

from llmgw.logbound import clip
from llmgw.model.inventory import SOFT_MARK, Gpu
from llmgw.server.cluster import Cluster
from llmgw.server.peers.sessions import OpHandler, Peer, RequestError
from llmgw.transport.gpu_ops import GpuClearOp
from llmgw.transport.messages import ClearGpu

ADMIN = frozenset({"admin"})


def find_gpu(gpus: tuple[Gpu, ...], which: str) -> Gpu | None:
    """The GPU `which` names: its UUID, or its index on the node."""
    for g in gpus:
        if g.uuid == which:
            return g
    if which.isdigit():
        for g in gpus:
            if g.index == int(which):
                return g
    return None


def is_xid(problem: str) -> bool:
    return problem.removeprefix(SOFT_MARK).startswith("Xid ")


class GpuClear:
    def __init__(self, o: Cluster) -> None:
        self.o = o

    def ops(self) -> dict[type, tuple[frozenset[str], OpHandler]]:
        return {GpuClearOp: (ADMIN, self.op_gpu_clear)}

    def op_gpu_clear(self, peer: Peer, op: GpuClearOp, now: float) -> Any:
        node = self.o.cp.nodes.get(op.node)
        if node is None:
            raise RequestError(f"no node named {clip(op.node, 100)!r}")
        gpu = find_gpu(node.inventory.gpus, op.gpu)
        if gpu is None:
            have = ", ".join(str(g.index) for g in node.inventory.gpus) or "none"
            raise RequestError(f"node {op.node} has no GPU {clip(op.gpu, 100)!r} (its GPUs: {have}; "
                               "give an index or a UUID)")
        if not (node.connected and node.routing_id):
            raise RequestError(f"node {op.node} is not connected: its agent cannot be told")
        self.o.send([(node.routing_id, ClearGpu((gpu.uuid,)))])
        return {"node": op.node, "index": gpu.index, "uuid": gpu.uuid,
                "cleared": [p for p in gpu.problems if is_xid(p)],
                "kept": [p for p in gpu.problems if not is_xid(p)]}
