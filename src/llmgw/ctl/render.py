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
    return f"{len(gpus)}x {'/'.join(names)} {free}/{total}GiB free ({n.get('gpu_source')})"


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


def _replicas_table(items: list[dict[str, Any]]) -> str:
    return table(["ID", "DEPLOYMENT", "STATE", "GEN", "NODES", "ENDPOINT", "REASON"], [
        [r["id"], r["deployment"], r["state"], r.get("generation", ""),
         ",".join(r.get("nodes", [])) or "-", r.get("endpoint", "") or "-", r.get("reason", "")]
        for r in items])


def _deployments_table(items: list[dict[str, Any]]) -> str:
    return table(["NAME", "MODEL", "ENGINE", "READY", "STATUS"], [
        [d["name"], d["model"], d["engine"], f"{d.get('ready', 0)}/{d.get('replicas', 0)}",
         d.get("status", "")] for d in items])


def _describe(d: dict[str, Any]) -> str:
    lines = [f"Name:      {d['name']}", f"Model:     {d['model']} (served as {d['served_name']})",
             f"Engine:    {d['engine']}", f"Replicas:  {d['ready']}/{d['replicas']} ready",
             f"Status:    {d['status']}", "Spec:"]
    lines += [f"  {k}: {v}" for k, v in d["spec"].items()]
    lines += ["", "Replicas:", _replicas_table(d["replica_list"])]
    for rid, why in d.get("pending", {}).items():
        lines.append(f"pending {rid}: {why}")
    for r in d["replica_list"]:
        if r.get("last_log_tail"):
            lines += ["", f"Last log of {r['id']}:", *("  " + x for x in r["last_log_tail"])]
    lines += ["", "Events:"]
    lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['ts']))}  {e['replica'] or '-'}  "
              f"{e['text']}" for e in d.get("events", [])]
    return "\n".join(lines)


def render(cmd: str, args: Any, result: Any) -> str:
    """Text for one ctl subcommand's result."""
    if cmd == "status":
        return render_status(result)
    if cmd == "get":
        if args.what == "deployments":
            return _deployments_table(result)
        if args.what == "replicas":
            return _replicas_table(result)
        return render_status({"nodes": result})
    if cmd == "describe":
        return _describe(result)
    if cmd == "logs":
        head = f"# {result['replica']} on {result['node'] or '-'}"
        if result.get("note"):
            head += f" ({result['note']})"
        return "\n".join([head, *result["lines"]])
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
        return f"deployment {result['deployment']} scaled to {result['replicas']}"
    state = "draining" if result.get("draining") else "cordoned" if result.get("cordoned") else "uncordoned"
    return f"node {result['node']} {state}"
