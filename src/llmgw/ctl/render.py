"""Plain-text tables for ctl. JSON output is the same data, printed as is."""

from __future__ import annotations

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


def render_status(st: dict[str, Any]) -> str:
    out: list[str] = []
    nodes = st.get("nodes", [])
    rows = [
        [
            n["id"], n["state"], _age(n), n["mgmt_addr"],
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
        frows = []
        for f in fabrics:
            models = []
            for m in f.get("models", []):
                where = [f"shared store {s}" for s in m.get("shared_stores", [])]
                if m.get("local_nodes"):
                    where.append(f"local copies on {len(m['local_nodes'])} nodes")
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
