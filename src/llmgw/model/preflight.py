"""What the agent's launcher and the server agree on about a failed pre-flight (issue 22).

A gang member whose required pre-flight failed never starts its engine: the launcher
says why in one log line (FAILED_LINE + the reason, e.g. "bus bandwidth 0.4 GB/s is below
10 GB/s", "timed out after 60s") and exits EXIT_CODE. The server reads both from the
engine's exit report (exit code and log tail) and, rather than restarting the gang in
place, places it again away from the nodes involved (server/reconcile/rules.py).
"""

from __future__ import annotations

from collections.abc import Iterable

EXIT_CODE = 3
FAILED_LINE = "llmgw launcher: pre-flight failed: "
# How long a gang's nodes whose pre-flight failed are avoided for new gang placements.
AVOID_SECONDS = 600.0


def failure(exit_code: int | None, log_tail: Iterable[str]) -> str:
    """The reason a pre-flight failed, from an engine's exit code and log tail; "" when
    the exit was not a pre-flight's."""
    if exit_code != EXIT_CODE:
        return ""
    why = ""
    for line in log_tail:
        i = line.find(FAILED_LINE)
        if i >= 0:
            why = line[i + len(FAILED_LINE):].strip()
    return "".join(c if c.isprintable() else "?" for c in why[:200])
