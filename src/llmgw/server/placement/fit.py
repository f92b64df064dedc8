"""Whether one node fits a replica: the per-node filters of placement (place.py), pure.

The filters and the free-GPU and download-space rules are those place.py's docstring
states; `_fit` answers for the nodes a ClusterView offers, `_wants` and `_ports_needed`
are shared with explain.py, which counts the same tests when nothing fits.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from llmgw.model.deployment import ENGINE_PORT_BLOCK, RAY_PORT_BLOCK, Deployment
from llmgw.model.engine import EngineKind
from llmgw.model.gpu_need import memory_need
from llmgw.model.inventory import Gpu, names_a_path
from llmgw.server.placement.cluster_view import ClusterView, _Node
from llmgw.server.placement.gpu_pick import pick_gpus

__all__ = ["download_room"]


def _blocked(d: Deployment) -> bool:
    """Whether each member gets an engine port block (ENGINE_PORT_BLOCK): vLLM and SGLang
    pick internal ports of their own; the simulated engine binds only the ports it is given."""
    return d.engine in (EngineKind.VLLM, EngineKind.SGLANG)


def _ports_needed(d: Deployment, head: bool) -> int:
    """Ports one member binds: HTTP; the engine block; a gang head's rendezvous (an SGLang
    head's lies in its engine block) and Ray GCS port; a vLLM gang member's Ray block."""
    count = 1
    if _blocked(d):
        count += ENGINE_PORT_BLOCK
    if d.nodes > 1:
        count += 1 if head and d.engine != EngineKind.SGLANG else 0
        if d.engine == EngineKind.VLLM:
            count += RAY_PORT_BLOCK + (1 if head else 0)
    return count


# MiB free an engine needs on a GPU, cached: _fit asks for every node it tries, and
# parsing the args each time would cost more than the rest of the fit.
_need = functools.lru_cache(maxsize=4096)(memory_need)


def _fit(n: _Node, d: Deployment) -> tuple[tuple[str, ...], bool] | None:
    """The GPUs this node would give, and whether they are an NVLink clique; None: no fit."""
    need = d.gpus_per_node
    if len(n.free) < need or d.engine in n.lacked:
        return None
    for k, v in d.selector.items():
        if n.labels.get(k) != v:
            return None
    key = (need, d.engine, d.args, d.gpu_memory_min)
    if key in n.cache:
        return n.cache[key]
    result: tuple[tuple[str, ...], bool] | None = None
    if (n.hi - n.lo + 1) - len(n.ports) >= _ports_needed(d, True):
        free = _roomy(n, d)
        if len(free) >= need:
            result = pick_gpus(free, need)
    n.cache[key] = result
    return result


def _roomy(n: _Node, d: Deployment) -> list[Gpu]:
    """The node's free GPUs (no replica of ours, placeable) with the engine's need free."""
    return [g for g, want in _wants(n, d) if g.memory_free >= want]


def _wants(n: _Node, d: Deployment) -> Iterator[tuple[Gpu, int]]:
    """Each free GPU of the node with the memory `d`'s engine needs free on it."""
    gpus = n.gpus
    needs: dict[int, int] = {}  # by GPU size: a node's GPUs are nearly always alike
    for u in n.free:
        g = gpus[u]
        want = needs.get(g.memory_total)
        if want is None:
            want = needs[g.memory_total] = _need(d.engine, d.args, g.memory_total, d.gpu_memory_min)
        yield g, want


def _download_need(view: ClusterView, d: Deployment) -> int:
    """Bytes a node without a copy must have free in download_dir for `d`'s model: its
    size where a node holds a complete copy; 0 (not checked) when unknown, or for a path
    (an engine given a path opens it, it downloads nothing)."""
    if names_a_path(d.model):
        return 0
    return view.model_size(d.model)


def download_room(need: int, free: int, held: int) -> int:
    """Bytes short for a download of `need` bytes into a folder with `free` bytes free
    that already holds `held` bytes of that same model (its download under way, or cut
    short: the hub client resumes and shares it); 0 when it fits, or when the size (0) or
    the free space (-1) is not known."""
    if need <= 0 or free < 0:
        return 0
    return max(0, need - max(0, held) - free)
