"""`llmgw ctl gpu clear NODE GPU` (GPU health): forget a GPU's Xid problems once the
operator has dealt with them (a reset the agent could not see, or an Xid judged harmless).

An Xid's problem also goes by itself when NVML's readings show the GPU was reset; what
NVML reports (a pending row remap, a recovery action, a lost GPU) is read again every
discovery and is not cleared by this.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from llmgw.errors import UsageError
from llmgw.transport.gpu_ops import GpuClearOp

VERBS = ("clear",)


def add_arguments(cmd: Callable[[str, str], argparse.ArgumentParser],
                  common: Callable[[argparse.ArgumentParser], None],
                  parser_class: type[argparse.ArgumentParser]) -> None:
    p = cmd("gpu", "a node's GPU: clear its Xid problems")
    sub = p.add_subparsers(dest="gpu_cmd", metavar="VERB", parser_class=parser_class)
    p.set_defaults(gpu_cmd=None)
    c = sub.add_parser("clear", help="forget the GPU's Xid problems (it was reset, or they are harmless)",
                       description="Forget the GPU's Xid problems: it takes new replicas again unless "
                                   "NVML itself reports a problem on it.")
    common(c)
    c.add_argument("node", metavar="NODE", help="the node's id")
    c.add_argument("gpu", metavar="GPU", help="the GPU's index on the node, or its UUID")


def op_of(args: argparse.Namespace) -> GpuClearOp:
    if args.gpu_cmd is None:
        raise UsageError("ctl gpu: expected a verb: " + ", ".join(VERBS))
    try:
        return GpuClearOp(args.node, args.gpu)
    except ValueError as exc:
        raise UsageError(f"ctl gpu clear: {exc}") from None


def render(result: dict[str, Any]) -> str:
    cleared = result.get("cleared") or []
    kept = result.get("kept") or []
    head = f"node {result['node']} GPU {result['index']} ({result['uuid']}): "
    text = head + (f"cleared {len(cleared)} Xid problem{'s' if len(cleared) != 1 else ''}"
                   if cleared else "no Xid problem to clear")
    if kept:
        text += "; NVML still reports: " + "; ".join(str(p) for p in kept)
    return text
