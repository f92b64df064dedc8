"""`llmgw ctl usage [--api-key K] [--model M] [--since 24h] [-o table|json|csv]` (API keys and limits):
what the routers metered per API key × model, as the server stores it (per hour and HTTP
status). The table adds the hours up per key and model; json and csv give the rows.
(`--api-key`, not `--key`: ctl's --key is the operator's CURVE key file.)"""

from __future__ import annotations

import argparse
import csv
import io
import time
from collections.abc import Callable
from typing import Any

from llmgw.ctl.apikey import period_seconds
from llmgw.ctl.render import table
from llmgw.errors import UsageError
from llmgw.transport.apikey_ops import UsageOp

FIELDS = ("hour", "api_key", "model", "status", "requests", "prompt_tokens",
          "completion_tokens", "latency_sum")


def add_arguments(cmd: Callable[[str, str], argparse.ArgumentParser]) -> None:
    u = cmd("usage", "requests and tokens per API key and model, as the routers metered them")
    u.add_argument("--api-key", metavar="NAME", default="", dest="api_key",
                   help="only this API key (its name)")
    u.add_argument("--model", metavar="NAME", default="", help="only this model")
    u.add_argument("--since", metavar="PERIOD", default="24h",
                   help="from this long ago on, counted in whole hours (default 24h; e.g. 90m, 7d)")


def op_of(args: argparse.Namespace, now: float | None = None) -> UsageOp:
    now = time.time() if now is None else now
    try:
        back = period_seconds(args.since)
    except ValueError:
        raise UsageError(f"ctl usage: --since: {args.since!r} is not a period (24h, 90m, 7d)") from None
    return UsageOp(args.api_key, args.model, max(0.0, now - back))


def totals(rows: list[dict[str, Any]]) -> list[list[object]]:
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        t = by.setdefault((r["api_key"], r["model"]), [0, 0, 0, 0, 0.0])
        t[0] += r["requests"]
        t[1] += r["requests"] if r["status"] >= 400 else 0
        t[2] += r["prompt_tokens"]
        t[3] += r["completion_tokens"]
        t[4] += r["latency_sum"]
    return [[k or "(no key)", m or "-", int(n), int(e), int(p), int(c),
             f"{lat / n * 1000:.0f}ms" if n else "-"]
            for (k, m), (n, e, p, c, lat) in sorted(by.items())]


def render(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    if args.output == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(FIELDS)
        for r in rows:
            w.writerow([r[f] for f in FIELDS])
        return buf.getvalue().rstrip("\n")
    if not rows:
        return "no usage in that time"
    return table(["KEY", "MODEL", "REQUESTS", "ERRORS", "PROMPT_TOKENS", "COMPLETION_TOKENS",
                  "MEAN_LATENCY"], totals(rows))
