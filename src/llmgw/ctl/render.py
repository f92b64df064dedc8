"""Plain-text tables for ctl. JSON output is the same data, printed as is."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def _gpus(n: dict[str, Any]) -> str:
    gpus = n.get("gpus") or []
    if not gpus:
        return f"0 ({n.get('gpu_source', 'none')})"
    names = sorted({g["name"] for g in gpus})
    free = sum(g.get("memory_free", 0) for g in gpus) // 1024
    total = sum(g.get("memory_total", 0) for g in gpus) // 1024
    text = f"{len(gpus)}x {'/'.join(names)} {free}/{total}GiB free ({n.get('gpu_source')})"
    # Not healthy: counted here, named GPU by GPU in `describe node`.
    states = [g.get("state", "healthy") for g in gpus]
    odd = [f"{states.count(s)} {s}" for s in ("unhealthy", "degraded", "releasing", "held")
           if s in states]
    return text + (", " + ", ".join(odd) if odd else "")


def _clip(text: object, width: int = 60) -> str:
    """A peer's text on one line, cut to `width`."""
    s = "".join(c if c.isprintable() else "?" for c in str(text))
    return s if len(s) <= width else s[: width - 1] + "…"


def _gib(mib: object) -> str:
    m = int(mib) if isinstance(mib, int) else 0
    return f"{m / 1024:.0f} GiB" if m >= 10240 else f"{m / 1024:.1f} GiB"


def _gpu_notes(gpus: list[dict[str, Any]]) -> list[str]:
    """Why each GPU that is not healthy is not: its problems, what holds it, what it
    waits to release. Every problem is shown; processes up to 5 per GPU."""
    lines = []
    for g in gpus:
        i = g.get("index", "?")
        for p in g.get("problems") or []:
            lines.append(f"  GPU {i} unhealthy: {_clip(p, 100)}")
        for p in g.get("soft_problems") or []:
            lines.append(f"  GPU {i} takes no new work: {_clip(p, 100)}")
        if g.get("releasing"):
            lines.append(f"  GPU {i} releasing: {_clip(g['releasing'], 100)}")
        procs = g.get("processes") or []
        for p in procs[:5]:
            mem = f", {_gib(p.get('memory'))}" if p.get("memory") else ""
            lines.append(f"  GPU {i} held by pid {p.get('pid', '?')} ({_clip(p.get('command', ''))}){mem}")
        if len(procs) > 5:
            lines.append(f"  GPU {i} held by {len(procs) - 5} more processes")
    return lines


def _storage(n: dict[str, Any]) -> str:
    s = n.get("storage") or {"asked": False}
    if not s.get("asked"):
        return "not asked"
    held = [m["name"] for m in s.get("models", []) if m.get("complete")]
    partial = [m["name"] for m in s.get("models", []) if not m.get("complete")]
    text = ", ".join(held) if held else "no models"
    if partial:
        text += f" (incomplete: {', '.join(partial)})"
    return text


def _download_dir(n: dict[str, Any]) -> list[str]:
    """Where the node's engines download a model it holds no copy of, with the space free
    there (placement refuses a download that would not fit); [] when none is set."""
    s = n.get("storage") or {}
    where = s.get("download_dir")
    if not where:
        return []
    free = s.get("download_free", -1)
    room = f"{free / 2**30:.1f} GiB free" if isinstance(free, int) and free >= 0 else "free space unknown"
    return [f"Downloads: {where} ({room})"]


def _age(n: dict[str, Any]) -> str:
    return f"{n.get('heartbeat_age', 0):.0f}s"


def node_state(n: dict[str, Any]) -> str:
    """`ready`, or kubectl's way for a cordoned node: `ready,SchedulingDisabled`."""
    state = n["state"]
    if n.get("draining"):
        return f"{state},SchedulingDisabled,Draining"
    if n.get("cordoned"):
        return f"{state},SchedulingDisabled"
    return str(state)


def render_status(st: dict[str, Any]) -> str:
    out: list[str] = []
    nodes = st.get("nodes", [])
    rows = [
        [
            n["id"], node_state(n), _age(n), n["mgmt_addr"],
            ",".join(f"{k}={v}" for k, v in sorted(n.get("labels", {}).items())) or "-",
            ",".join(f"{f['name']}({f['state']})" for f in n.get("fabrics", [])) or "island",
            _gpus(n), _storage(n),
        ]
        for n in nodes
    ]
    out.append(f"NODES ({len(nodes)})")
    out.append(table(["ID", "STATE", "HEARTBEAT", "MGMT_ADDR", "LABELS", "FABRICS", "GPUS", "STORAGE"],
                     rows))
    fabrics = st.get("fabrics")
    if fabrics is not None:
        out.append("")
        out.append(f"FABRICS ({len(fabrics)})")
    if fabrics:
        frows = []
        for f in fabrics:
            models = []
            for m in f.get("models", []):
                where = [f"shared store {s}" for s in m.get("shared_stores", [])]
                if m.get("local_nodes"):
                    n = len(m["local_nodes"])
                    where.append(f"local cop{'y' if n == 1 else 'ies'} on {n} node{'' if n == 1 else 's'}")
                models.append(f"{m['name']} ({'; '.join(where)})")
            frows.append([f["name"], len(f.get("nodes", [])), f.get("gpus", 0),
                          "; ".join(models) or "no models"])
        out.append(table(["FABRIC", "NODES", "GPUS", "CAN SERVE"], frows))
    out += fabric_preflight_lines(st.get("preflight"))
    islands = st.get("islands") or []
    if islands:
        out.append(f"islands (no fabric, single-node replicas only): {', '.join(islands)}")
    for section in ("deployments", "replicas"):
        items = st.get(section)
        if items is None:
            continue
        out.append("")
        out.append(f"{section.upper()} ({len(items)})")
        if section == "deployments":
            out.append(table(["NAME", "MODEL", "ENGINE", "READY", "STATUS"], [
                [d["name"], d["model"], d["engine"], f"{d.get('ready', 0)}/{d.get('replicas', 0)}",
                 d.get("status", "")] for d in items]))
        else:
            out.append(table(["ID", "DEPLOYMENT", "STATE", "NODES", "ENDPOINT"], [
                [r["id"], r["deployment"], r["state"], ",".join(r.get("nodes", [])) or "-",
                 r.get("endpoint", "") or "-"] for r in items]))
    notes = st.get("notes") or []
    for note in notes:
        out.append(f"note: {note}")
    return "\n".join(out)


def _replicas_table(items: list[dict[str, Any]], wide: bool = True) -> str:
    if not wide:
        return table(["ID", "DEPLOYMENT", "STATE", "NODES", "ENDPOINT"], [
            [r["id"], r["deployment"], r["state"], ",".join(r.get("nodes", [])) or "-",
             r.get("endpoint", "") or "-"] for r in items])
    return table(["ID", "DEPLOYMENT", "STATE", "GEN", "NODES", "GPUS", "FABRIC", "RESTARTS",
                  "ENDPOINT", "REASON"], [
        [r["id"], r["deployment"], r["state"], r.get("generation", ""),
         ",".join(r.get("nodes", [])) or "-", _replica_gpus(r), r.get("fabric", "") or "-",
         r.get("restarts", 0), r.get("endpoint", "") or "-", r.get("reason", "")]
        for r in items])


def _replica_gpus(r: dict[str, Any]) -> str:
    gpus = r.get("gpus") or []
    return ",".join(str(g) for g in gpus) or "-"


def _deployments_table(items: list[dict[str, Any]], wide: bool = False) -> str:
    if not wide:
        return table(["NAME", "MODEL", "ENGINE", "READY", "STATUS"], [
            [d["name"], d["model"], d["engine"], f"{d.get('ready', 0)}/{d.get('replicas', 0)}",
             d.get("status", "")] for d in items])
    return table(["NAME", "MODEL", "SERVED AS", "ENGINE", "READY", "STATUS"], [
        [d["name"], d["model"], d.get("served_name", "") or "-", d["engine"],
         f"{d.get('ready', 0)}/{d.get('replicas', 0)}", d.get("status", "")] for d in items])


def _nodes_table(nodes: list[dict[str, Any]], wide: bool) -> str:
    if wide:
        return render_status({"nodes": nodes})
    return table(["ID", "STATE", "HEARTBEAT", "FABRICS", "GPUS"], [
        [n["id"], node_state(n), _age(n),
         ",".join(f"{f['name']}({f['state']})" for f in n.get("fabrics", [])) or "island",
         _gpus(n)] for n in nodes])


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def _events(events: list[dict[str, Any]]) -> list[str]:
    return ["", "Events:", *(f"  {_clock(e['ts'])}  {e['replica'] or '-'}  {e['text']}"
                             for e in events)]


def _describe(d: dict[str, Any]) -> str:
    lines = [f"Name:      {d['name']}", f"Model:     {d['model']} (served as {d['served_name']})",
             f"Engine:    {d['engine']}", f"Replicas:  {d['ready']}/{d['replicas']} ready",
             f"Status:    {d['status']}"]
    if d.get("lora"):
        lines.append(f"LoRA:      {d['lora']}")
    lines.append("Spec:")
    lines += [f"  {k}: {v}" for k, v in d["spec"].items()]
    lines += ["", "Replicas:", _replicas_table(d["replica_list"])]
    for rid, why in d.get("pending", {}).items():
        lines.append(f"pending {rid}: {why}")
    lines += _kv_relays(d.get("kv_relays"))
    for r in d["replica_list"]:
        if r.get("last_log_tail"):
            lines += ["", f"Last log of {r['id']}:", *("  " + x for x in r["last_log_tail"])]
    lines += _events(d.get("events", []))
    return "\n".join(lines)


def _kv_relays(relays: object) -> list[str]:
    """Where routers follow each replica's KV-cache events (kv_events): its head node's
    agent relay, or why nowhere."""
    if not isinstance(relays, dict):
        return []
    return [f"KV events of {rid}: relayed at {at}" if at else
            f"KV events of {rid}: not relayed (its head node's agent has no relay: kv_relay_port 0, "
            "or an agent from before relays)"
            for rid, at in sorted(relays.items())]


def _describe_node(n: dict[str, Any]) -> str:
    lines = [f"Node:      {n['id']}", f"State:     {node_state(n)}",
             f"Connected: {'yes' if n.get('connected') else 'no'} "
             f"(heartbeat {_age(n)} ago)",
             f"Mgmt addr: {n.get('mgmt_addr', '')}",
             f"KV relay:  {n.get('kv_relay') or 'none'}",
             "Labels:    " + (", ".join(f"{k}={v}" for k, v in sorted(n.get("labels", {}).items()))
                              or "-"),
             "Fabrics:   " + (", ".join(f"{f['name']} ({f['state']}: {', '.join(f.get('hcas', []))})"
                                       for f in n.get("fabrics", [])) or "none (island)"),
             f"Storage:   {_storage(n)}", *_download_dir(n), "", f"GPUs: {_gpus(n)}"]
    gpus = n.get("gpus") or []
    if gpus:
        lines.append(table(["INDEX", "NAME", "STATE", "MEMORY FREE/TOTAL", "NUMA", "NVLINK PEERS"], [
            [g.get("index", ""), g.get("name", ""), g.get("state", "healthy"),
             f"{g.get('memory_free', 0) // 1024}/{g.get('memory_total', 0) // 1024}GiB",
             g.get("numa_node", ""),
             ",".join(str(p) for p in sorted((g.get("nvlink_peers") or {}).keys())) or "-"]
            for g in gpus]))
        lines += _gpu_notes(gpus)
    lines += _hca_notes(n.get("hcas") or [])
    lines += fabric_preflight_lines(n.get("preflight"))
    if isinstance(local := n.get("preflight_gpus"), dict):  # a single-node replica's (collective pre-flight)
        lines.append(f"pre-flight on its GPUs: {local.get('busbw_gbps', 0):.3g} GB/s bus bandwidth "
                     f"({local.get('replica', '?')}, one node)")
    for w in n.get("warnings", []):
        lines.append(f"warning: {w}")
    lines += ["", "Replicas:"]
    reps = n.get("replica_list", [])
    lines.append(_replicas_table(reps, wide=False) if reps else "  none")
    return "\n".join(lines)


def _hca_notes(hcas: list[Any]) -> list[str]:
    """One line per unhealthy HCA (the HCA watch's problems): out of its fabric."""
    out = []
    for h in hcas:
        if isinstance(h, dict) and not h.get("healthy", True):
            why = "; ".join(str(p) for p in h.get("problems") or []) or "no active port"
            out.append(f"HCA {h.get('name', '?')} unhealthy, not counted in its fabric: {why}")
    return out


def _weights(w: object) -> list[str]:
    """The weights each member's engine loads (the agent's EngineReport.weights): the copy
    used (path, local or shared, the store) or where it downloads. A dict node -> line, or
    one line; absent from a server that does not pass it on."""
    if isinstance(w, dict):
        told = [(n, x) for n, x in sorted(w.items()) if x]
        if len(told) == 1:
            return [f"Weights:    {told[0][1]} (on {told[0][0]})"]
        return ["Weights:", *(f"  {n}: {x}" for n, x in told)] if told else []
    return [f"Weights:    {w}"] if isinstance(w, str) and w else []


def _download(d: object) -> list[str]:
    """How far each member's engine has downloaded its weights into download_dir (the
    agent's EngineReport.download: bytes on disk, the rate): a dict node -> line."""
    if not isinstance(d, dict):
        return []
    told = [(n, x) for n, x in sorted(d.items()) if x]
    if len(told) == 1:
        return [f"Download:   {told[0][1]} (on {told[0][0]})"]
    return ["Download:", *(f"  {n}: {x}" for n, x in told)] if told else []


def _nics(nics: object) -> list[str]:
    """Which HCA each gang member's GPUs ride (the server's "nics": node -> lines)."""
    if not isinstance(nics, dict) or not nics:
        return []
    out = ["HCAs:"]
    for node, lines in sorted(nics.items()):
        if isinstance(lines, list):
            out.append(f"  {node}: " + ", ".join(str(x) for x in lines))
    return out if len(out) > 1 else []


def _member_preflight(p: object) -> list[str]:
    """Each member's pre-flight (EngineReport.preflight, the collective pre-flight): node -> line."""
    if not isinstance(p, dict) or not p:
        return []
    return ["Pre-flight:", *(f"  {node}: {line}" for node, line in sorted(p.items()))]


def fabric_preflight_lines(p: object) -> list[str]:
    """The last passed pre-flight per fabric (the server's "preflight": fabric -> {replica,
    busbw_gbps, members}): one line each."""
    if not isinstance(p, dict):
        return []
    out = []
    for fabric, fig in sorted(p.items()):
        if isinstance(fig, dict):
            out.append(f"pre-flight on {fabric}: {fig.get('busbw_gbps', 0):.3g} GB/s bus bandwidth "
                       f"(slowest member of {fig.get('replica', '?')}, "
                       f"{', '.join(sorted(fig.get('members') or {}))})")
    return out


def _adapters(a: object) -> list[str]:
    """The LoRA adapters the head engine has loaded, and why any it should have is not
    (EngineReport.adapters / adapter_errors): a dict node -> {loaded, errors}."""
    if not isinstance(a, dict):
        return []
    out = []
    for node, facts in sorted(a.items()):
        if not isinstance(facts, dict):
            continue
        loaded = ", ".join(str(x) for x in facts.get("loaded") or []) or "none"
        out.append(f"Adapters:   {loaded} (on {node})")
        out += [f"  not loaded: {e}" for e in facts.get("errors") or []]
    return out


def _describe_replica(r: dict[str, Any]) -> str:
    lines = [f"Replica:    {r['id']}", f"Deployment: {r['deployment']}",
             f"State:      {r['state']}" + (f" ({r['reason']})" if r.get("reason") else ""),
             f"Generation: {r.get('generation', '')}", f"Restarts:   {r.get('restarts', 0)}",
             "Nodes:      " + (", ".join(r.get("nodes", [])) or "-"),
             f"GPUs:       {_replica_gpus(r)}", f"Fabric:     {r.get('fabric') or '-'}",
             f"Endpoint:   {r.get('endpoint') or '-'}"]
    lines += _weights(r.get("weights"))
    lines += _download(r.get("download"))
    lines += _adapters(r.get("adapters"))
    lines += _nics(r.get("nics"))
    lines += _member_preflight(r.get("preflight"))
    if r.get("replaces"):
        lines.append(f"Replaces:   {r['replaces']}")
    if r.get("pending"):
        lines.append(f"Pending:    {r['pending']}")
    spec = r.get("spec") or {}
    if spec:
        lines += ["Spec:", *(f"  {k}: {v}" for k, v in spec.items())]
    if r.get("last_log_tail"):
        lines += ["", "Last log:", *("  " + x for x in r["last_log_tail"])]
    lines += _events(r.get("events", []))
    return "\n".join(lines)


def logs_head(result: dict[str, Any]) -> str:
    head = f"# {result['replica']} on {result['node'] or '-'}"
    if result.get("note"):
        head += f" ({result['note']})"
    return head


def render(cmd: str, kind: str, result: Any, *, wide: bool = False) -> str:
    """Text for one ctl subcommand's result; `kind` is get's or describe's (singular)."""
    if cmd == "status":
        return render_status(result)
    if cmd == "get":
        rows = result if isinstance(result, list) else [result]  # `get KIND NAME`: one
        if kind == "deployment":
            return _deployments_table(rows, wide)
        if kind == "replica":
            return _replicas_table(rows, wide)
        return _nodes_table(rows, wide)
    if cmd == "describe":
        if kind == "node":
            return _describe_node(result)
        if kind == "replica":
            return _describe_replica(result)
        return _describe(result)
    if cmd == "logs":
        return "\n".join([logs_head(result), *result["lines"]])
    if cmd == "apply":
        if not result.get("changed"):
            return f"deployment {result['deployment']} unchanged"
        return f"deployment {result['deployment']} {result['action']}"
    if cmd == "delete":
        return f"deployment {result['deployment']} deleted"
    if cmd == "rediscover":
        text = f"asked {', '.join(result['asked']) or 'no node'} to run discovery"
        if result["not_connected"]:
            text += f"; not connected: {', '.join(result['not_connected'])}"
        return text
    if cmd == "scale":
        text = f"deployment {result['deployment']} scaled to {result['replicas']}"
        return f"{text} ({result['note']})" if result.get("note") else text
    state = "draining" if result.get("draining") else "cordoned" if result.get("cordoned") else "uncordoned"
    return f"node {result['node']} {state}"
