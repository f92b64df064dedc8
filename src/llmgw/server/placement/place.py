"""Placement: where one replica goes, as a pure function over an inventory snapshot.

Filters: the node is ready and neither cordoned nor draining; it can start the
deployment's engine kind (an inventory that does not say counts as able); its labels
match the selector; it has enough free GPUs; for a gang (`nodes > 1`) every member
shares one fabric that is not down on any of them and has the same GPU model. Islands
(no fabrics) never hold a multi-node replica.

A free GPU is one no replica of ours holds, placeable (no problem, hard or soft, and not releasing, as the
agent reports it) and with at least the engine's need in free memory:
`memory_need(engine, args, total, gpu_memory_min)` (vLLM's --gpu-memory-utilization x
total, SGLang's --mem-fraction-static, 0.9 by default, plus the engine's own CUDA context,
CONTEXT_RESERVE; gpu_memory_min a floor). vLLM refuses to start below that, so a GPU
other processes hold is no answer at all.

Space: a node that would download the model (it holds no complete copy) and reports less
free space in its download_dir than the model's size is no fit, where both are known: the
size from another node's complete copy, the free space from the agent's storage scan. The
bytes of that model already in its download_dir (a download under way or cut short, which
the next engine there shares or resumes) count as its room: a second replica on the node,
or a restart mid-download, needs only the rest free, and is not charged the whole size
again for what the first download already took.
Holding weights is never required (a download is a valid answer).
A gang's placement also names the path at which every member holds a complete copy, if
one does (gang_weights.py): its head may then start on a local copy.

Preference, never a filter, in this order: holding complete weights for the model (for
a gang, the more members that hold them the better); then NVLink fit of the
tensor-parallel group; then the strategy (pack: fewest free GPUs, spread: most).

When nothing fits, `explain` counts the nodes by why, and for a few nodes that GPUs
other than ours kept out, names what: "n3: GPU 2 unhealthy (row remap pending); GPUs
0,1 held by other processes (pid 4242 python train.py 61 GiB); 3 GPUs with >= 72 GiB
free, 4 needed". Bounded in length, whatever the nodes report.

Speed: a ClusterView (cluster_view.py) indexes the nodes (free-GPU buckets per fabric and
GPU model, an inverted index of who holds which model) so that one placement looks at a
handful of nodes, not all of them. It is a plain value owned by its caller, kept across
passes by the reconcile state and updated by deltas.
"""

from __future__ import annotations

import functools
import heapq
from collections import Counter
from collections.abc import Iterator, Mapping

from attrs import field, frozen

from llmgw.model.deployment import (
    ENGINE_PORT_BLOCK,
    RAY_PORT_BLOCK,
    SGLANG_DIST_INIT,
    Deployment,
    Member,
    Strategy,
)
from llmgw.model.engine import EngineKind
from llmgw.model.gpu_need import memory_need
from llmgw.model.inventory import Gpu, names_a_path
from llmgw.server.placement.cluster_view import ClusterView, NodeView, _Group, _Node
from llmgw.server.placement.gang_weights import gang_weights_path
from llmgw.server.placement.gpu_pick import pick_gpus

__all__ = ["ClusterView", "NodeView", "Placement", "Unschedulable", "explain", "place"]

_SCAN_HOLDERS_DIRECTLY = 256  # above this many holders, scan buckets instead


@frozen
class Placement:
    members: tuple[Member, ...]
    fabric: str = ""
    holders: int = 0  # members that hold complete weights
    nvlink: int = 0  # members whose GPUs form an NVLink clique
    # A gang: the path at which every member's scan found a complete copy of the model
    # (gang_weights.py); "": none, or not a gang.
    weights_path: str = ""


@frozen
class Unschedulable:
    reason: str
    counts: dict[str, int] = field(factory=dict)


# ---------------------------------------------------------------- choosing


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


@frozen
class _Choice:
    node: _Node
    gpus: tuple[str, ...]
    holds: bool
    nvlink: bool

    def strat(self, strategy: Strategy) -> int:
        left = len(self.node.free) - len(self.gpus)
        return -left if strategy == Strategy.PACK else left


def _pick(
    view: ClusterView, group: _Group, d: Deployment, exclude: frozenset[str]
) -> list[_Choice] | None:
    """The best `d.nodes` nodes of one group, best first; None when too few fit."""
    k = d.nodes
    holders = view.holders.get(d.model, set())
    need = _download_need(view, d)
    chosen: list[_Choice] = []
    if holders:
        if len(holders) <= _SCAN_HOLDERS_DIRECTLY:
            for nid in sorted(holders):
                n = view.nodes[nid]
                if nid in group.ids and nid not in exclude:
                    r = _fit(n, d)
                    if r is not None:
                        chosen.append(_Choice(n, r[0], True, r[1]))
            chosen.sort(key=lambda c: (not c.nvlink, -c.strat(d.strategy)))
            chosen = chosen[:k]
        else:
            chosen = _scan(group, d, k, exclude, lambda nid: nid in holders, True)
    if len(chosen) < k:
        taken = exclude | {c.node.id for c in chosen}
        nodes = view.nodes
        chosen += _scan(group, d, k - len(chosen), taken,
                        lambda nid: nid not in holders and not _room(nodes[nid], need, d.model), False)
    return chosen if len(chosen) == k else None


def _scan(
    group: _Group, d: Deployment, want: int, exclude: frozenset[str], ok: object, holds: bool
) -> list[_Choice]:
    """Up to `want` fitting nodes in strategy order, NVLink fits first; stops early."""
    good: list[_Choice] = []
    fallback: list[_Choice] = []
    for n in group.scan(d.gpus_per_node, d.strategy):
        if n.id in exclude or not ok(n.id):  # type: ignore[operator]
            continue
        r = _fit(n, d)
        if r is None:
            continue
        c = _Choice(n, r[0], holds, r[1])
        if c.nvlink:
            good.append(c)
            if len(good) >= want:
                break
        elif len(fallback) < want:
            fallback.append(c)
    return (good + fallback)[:want]


def _score(chosen: list[_Choice], strategy: Strategy) -> tuple[int, int, int]:
    return (
        sum(c.holds for c in chosen),
        sum(c.nvlink for c in chosen),
        sum(c.strat(strategy) for c in chosen),
    )


def place(
    deployment: Deployment,
    nodes: Mapping[str, NodeView] | ClusterView,
    *,
    exclude: frozenset[str] = frozenset(),
) -> Placement | Unschedulable:
    """Where one replica of `deployment` goes. Reserves nothing: call view.reserve()."""
    view = nodes if isinstance(nodes, ClusterView) else ClusterView(nodes)
    d = deployment
    if d.nodes == 1:
        groups = [("", view.all)]
    else:
        groups = [(key[0], g) for key, g in sorted(view.groups.items())]
    best: tuple[tuple[int, int, int], str, list[_Choice]] | None = None
    for fabric, group in groups:
        chosen = _pick(view, group, d, exclude)
        if chosen is None:
            continue
        score = _score(chosen, d.strategy)
        if best is None or score > best[0]:
            best = (score, fabric, chosen)
    if best is None:
        return explain(d, view, exclude)
    _, fabric, chosen = best
    chosen.sort(key=lambda c: (not c.holds, not c.nvlink, -c.strat(d.strategy)))
    members = _members(d, fabric, chosen)
    if members is None:  # a port range too fragmented for a Ray block: leave those out
        return place(d, view, exclude=exclude | {c.node.id for c in chosen})
    return Placement(
        members=members,
        fabric=fabric,
        holders=sum(c.holds for c in chosen),
        nvlink=sum(c.nvlink for c in chosen),
        weights_path=gang_weights_path(d.model, [c.node.view.inventory.storage for c in chosen])
        if d.nodes > 1 else "",
    )


def _members(d: Deployment, fabric: str, chosen: list[_Choice]) -> tuple[Member, ...] | None:
    gang = d.nodes > 1
    ray = gang and d.engine == EngineKind.VLLM
    head_ports: dict[str, int] = {}
    out: list[Member] = []
    for rank, c in enumerate(chosen):
        n = c.node
        taken = set(n.ports)
        port = _free_port(n, taken)
        if port is None:
            return None
        taken.add(port)
        engine_base = 0
        if _blocked(d):
            found = _free_block(n, taken, ENGINE_PORT_BLOCK)
            if found is None:
                return None
            engine_base = found
            taken.update(range(found, found + ENGINE_PORT_BLOCK))
        if rank == 0 and gang:
            if d.engine == EngineKind.SGLANG:
                # SGLang's dist-init port and, with dp attention, the six after it: all
                # inside the head's own block (model/deployment.py's layout).
                rdzv: int | None = engine_base + SGLANG_DIST_INIT
            else:
                rdzv = _free_port(n, taken)
            if rdzv is None:
                return None
            taken.add(rdzv)
            head_ports["rdzv"] = rdzv
            if ray:
                gcs = _free_port(n, taken)
                if gcs is None:
                    return None
                taken.add(gcs)
                head_ports["ray"] = gcs
        base = 0
        if ray:
            found = _free_block(n, taken, RAY_PORT_BLOCK)
            if found is None:
                return None
            base = found
        out.append(
            Member(
                node_id=n.id,
                rank=rank,
                gpus=c.gpus,
                port=port,
                addr=n.addr,
                rendezvous_port=head_ports.get("rdzv", 0),
                ray_port=head_ports.get("ray", 0),
                ray_port_base=base,
                hcas=n.fabrics[fabric].hcas if gang else (),
                port_base=engine_base,
            )
        )
    return tuple(out)


def _free_port(n: _Node, taken: set[int]) -> int | None:
    for p in range(n.lo, n.hi + 1):
        if p not in taken:
            return p
    return None


def _free_block(n: _Node, taken: set[int], size: int) -> int | None:
    start = n.lo
    while start + size - 1 <= n.hi:
        clash = [p for p in range(start, start + size) if p in taken]
        if not clash:
            return start
        start = clash[-1] + 1
    return None


# ---------------------------------------------------------------- explaining


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
