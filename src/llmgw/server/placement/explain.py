"""Why nothing fits: placement's reasons (place.py returns `explain`'s answer), pure.

When nothing fits, `explain` counts the nodes by why, and for a few nodes that GPUs
other than ours kept out, names what: "n3: GPU 2 unhealthy (row remap pending); GPUs
0,1 held by other processes (pid 4242 python train.py 61 GiB); 3 GPUs with >= 72 GiB
free, 4 needed". Bounded in length, whatever the nodes report.
"""

from __future__ import annotations

import heapq
from collections import Counter

from attrs import field, frozen

from llmgw.model.deployment import Deployment
from llmgw.server.placement.cluster_view import ClusterView, _Node
from llmgw.server.placement.fit import _download_need, _need, _ports_needed, _wants, download_room

__all__ = ["Unschedulable", "explain"]


@frozen
class Unschedulable:
    reason: str
    counts: dict[str, int] = field(factory=dict)


def _room(n: _Node, need: int, model: str) -> str:
    """Why `n` cannot take a download of `need` bytes of `model`; "" when it can, or when
    the size or its free space is not known."""
    held = n.downloading.get(model, 0)
    if not download_room(need, n.download_free, held):
        return ""
    there = f" ({_gib_bytes(held)} of it already there)" if held > 0 else ""
    return (f"download_dir {_text(n.download_dir, _PATH_CHARS)} has {_gib_bytes(n.download_free)} free, "
            f"the model needs {_gib_bytes(need)}{there}")


def _gib_bytes(n: int) -> str:
    return _gib(n // 2**20)


_DETAILED = 3  # nodes whose GPUs one reason names, the closest to fitting first
_DETAIL_CHARS = 300  # of one node's account
_ITEMS = 2  # problems or processes named per group of GPUs; the rest are counted
_TEXT_CHARS = 48  # of one problem, command or releasing reason, as the agent sent it
_PATH_CHARS = 160  # of a download_dir named in a reason: the operator must find it


def _reject(n: _Node, d: Deployment, exclude: frozenset[str]) -> str:
    return _why(n, d, exclude)[0]


def _why(n: _Node, d: Deployment, exclude: frozenset[str], need: int = 0) -> tuple[str, int]:
    """Why `n` does not fit (empty: it does), and, where GPUs other than those our
    replicas hold kept it out (unhealthy, releasing, held by other processes, short of
    memory), how many of its GPUs would do; -1 otherwise. `need`: the bytes a download
    of the model takes (_download_need)."""
    if n.reject:
        return n.reject, -1
    if n.id in exclude:
        return "were excluded", -1
    if any(n.labels.get(k) != v for k, v in d.selector.items()):
        return "lacked labels " + ",".join(f"{k}={v}" for k, v in sorted(d.selector.items())), -1
    if d.engine in n.lacked:
        return n.lacked[d.engine], -1
    k = d.gpus_per_node
    # _roomy's test, counted: explain asks it of every node.
    roomy = short = 0
    used = False  # some GPU short because something uses its memory, not too small
    for g, want in _wants(n, d):
        if g.memory_free >= want:
            roomy += 1
        else:
            short = max(short, want)
            used = used or g.memory_total >= want
    if roomy < k:
        what = f"lacked {k} free GPU{'s' if k != 1 else ''}"
        if short:
            what += f" with {_gib(short)} free"
        return what, roomy if used or n.out else -1
    if (n.hi - n.lo + 1) - len(n.ports) < _ports_needed(d, True):
        return "lacked free ports", -1
    if d.nodes > 1:
        if not n.view.inventory.fabrics:
            return "lacked fabric", -1
        if not n.fabrics:
            return "had their fabric down", -1
    if _room(n, need, d.model) and not n.view.inventory.storage.holds(d.model):
        return _SHORT_OF_SPACE.format(_gib_bytes(need)), -1
    return "", -1


# explain's count of nodes short of download space; the closest few are then named.
_SHORT_OF_SPACE = "lacked {} free in download_dir for the model"


def _gib(mib: int) -> str:
    return f"{mib / 1024:.0f} GiB" if mib >= 10240 else f"{mib / 1024:.1f} GiB"


def _text(s: str, limit: int = _TEXT_CHARS) -> str:
    """What a node sent, fit for one line of a reason: printable, bounded."""
    s = "".join(c if c.isprintable() else "?" for c in s[: limit + 1])
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _listed(items: list[str]) -> str:
    more = len(items) - _ITEMS
    return ", ".join(items[:_ITEMS]) + (f", +{more} more" if more > 0 else "")


def _which(indexes: list[int]) -> str:
    """"GPU 3", "GPUs 0-3,6": runs of indexes; at most 8 runs named."""
    runs: list[list[int]] = []
    for i in sorted(indexes):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    shown = ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:8])
    more = f",+{len(runs) - 8} more" if len(runs) > 8 else ""
    return f"GPU{'s' if len(indexes) != 1 else ''} {shown}{more}"


def _gpu_account(n: _Node, d: Deployment, roomy: int) -> str:
    """What keeps `n`'s GPUs from a replica of `d`, GPU by GPU, grouped by cause:
    "GPU 2 unhealthy (row remap pending); GPUs 0,1 held by other processes (pid 4242
    python train.py 61 GiB); GPU 4 releasing (...); 3 GPUs with >= 72 GiB free, 4 needed"."""
    free = set(n.free)
    unhealthy: dict[tuple[str, ...], list[int]] = {}
    degraded: dict[tuple[str, ...], list[int]] = {}
    releasing: dict[str, list[int]] = {}
    held: dict[tuple[tuple[int, str, int], ...], list[int]] = {}
    short: list[tuple[int, int]] = []
    small: list[int] = []
    ours: list[int] = []
    need = 0
    for g in n.gpus.values():
        if g.hard_problems:
            unhealthy.setdefault(g.hard_problems, []).append(g.index)
        elif g.problems:
            degraded.setdefault(g.soft_problems, []).append(g.index)
        elif g.releasing:
            releasing.setdefault(g.releasing, []).append(g.index)
        elif g.uuid not in free:
            ours.append(g.index)
        else:
            want = _need(d.engine, d.args, g.memory_total, d.gpu_memory_min)
            need = max(need, want)
            if g.memory_free >= want:
                continue
            if g.memory_total < want:
                small.append(g.index)
            elif g.processes:
                key = tuple((p.pid, p.command, p.memory) for p in g.processes)
                held.setdefault(key, []).append(g.index)
            else:
                short.append((g.index, g.memory_free))
    parts = [f"{_which(ix)} unhealthy ({_listed([_text(p) for p in why])})"
             for why, ix in sorted(unhealthy.items(), key=lambda x: min(x[1]))]
    parts += [f"{_which(ix)} taking no new work ({_listed([_text(p) for p in why])})"
              for why, ix in sorted(degraded.items(), key=lambda x: min(x[1]))]
    for procs, ix in sorted(held.items(), key=lambda x: min(x[1])):
        names = [f"pid {pid} {_text(cmd)}" + (f" {_gib(mem)}" if mem else "")
                 for pid, cmd, mem in procs]
        parts.append(f"{_which(ix)} held by other processes ({_listed(names)})")
    if short:
        least = min(m for _, m in short)
        parts.append(f"{_which([i for i, _ in short])} short of memory ({_gib(least)} free)")
    parts += [f"{_which(ix)} releasing ({_text(why)})"
              for why, ix in sorted(releasing.items(), key=lambda x: min(x[1]))]
    if small:
        parts.append(f"{_which(small)} too small")
    if ours:
        parts.append(f"{_which(ours)} held by replicas")
    k = d.gpus_per_node
    enough = f" with >= {_gib(need)} free" if need else " free"
    parts.append(f"{roomy} GPU{'s' if roomy != 1 else ''}{enough}, {k} needed")
    out = "; ".join(parts)
    return out if len(out) <= _DETAIL_CHARS else out[: _DETAIL_CHARS - 1] + "…"


def explain(
    d: Deployment, view: ClusterView, exclude: frozenset[str] = frozenset()
) -> Unschedulable:
    """Why no node (or no fabric, for a gang) fits, aggregated over the nodes; then, for
    the few nodes closest to fitting that GPUs other than ours kept out, what did."""
    counts: Counter[str] = Counter()
    fit = 0
    by_group: Counter[tuple[str, str]] = Counter()
    close: list[tuple[int, str]] = []
    need = _download_need(view, d)
    short_key = _SHORT_OF_SPACE.format(_gib_bytes(need))
    short: list[tuple[int, str]] = []  # (-free bytes, node) of those short of space
    for n in view.nodes.values():
        why, roomy = _why(n, d, exclude, need)
        if why:
            counts[why] += 1
            if roomy >= 0:
                close.append((-roomy, n.id))
            elif why == short_key:
                short.append((-n.download_free - n.downloading.get(d.model, 0), n.id))
        else:
            fit += 1
            for fabric in n.fabrics:
                by_group[(fabric, n.gpu_name)] += 1
    total = len(view.nodes)
    parts = [f"{c} {why}" for why, c in sorted(counts.items(), key=lambda x: (-x[1], x[0]))]
    if d.nodes > 1:
        best = max(by_group.values(), default=0)
        head = f"0/{total} nodes fit a {d.nodes}-node replica"
        if fit:
            parts.insert(
                0,
                f"{fit} fit alone but no fabric has {d.nodes} of them with one GPU model "
                f"(at most {best})",
            )
    else:
        head = f"0/{total} nodes fit"
    if not total:
        parts = ["no nodes known"]
    reason = f"{head}: " + ", ".join(parts)
    for minus, nid in heapq.nsmallest(_DETAILED, close):
        reason += f". {nid}: {_gpu_account(view.nodes[nid], d, -minus)}"
    if len(close) > _DETAILED:
        reason += f". {len(close) - _DETAILED} more nodes kept out by GPUs that are not ours"
    for _, nid in heapq.nsmallest(_DETAILED, short):  # the most space first
        reason += f". {nid}: {_room(view.nodes[nid], need, d.model)}"
    return Unschedulable(reason=reason, counts=dict(counts))
