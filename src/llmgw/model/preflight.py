"""What the agent's launcher and the server agree on about a failed pre-flight (collective pre-flight).

A gang member whose required pre-flight failed never starts its engine: the launcher
says why in one log line (FAILED_LINE + the reason, e.g. "bus bandwidth 0.4 GB/s is below
10 GB/s", "timed out after 60s") and exits EXIT_CODE. The server reads both from the
engine's exit report (exit code and log tail) and, rather than restarting the gang in
place, places it again away from the nodes involved (server/reconcile/rules.py); when the
probe's rendezvous port was in use (PORT_IN_USE), again on another port, avoiding no node.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

EXIT_CODE = 3
FAILED_LINE = "llmgw launcher: pre-flight failed: "
# How long a gang's nodes whose pre-flight failed are avoided for new gang placements.
AVOID_SECONDS = 600.0
# A probe that could not bind its rendezvous port (another process held it) fails with a
# reason that begins so: the port's fault, not the nodes'. The server places the replica
# again on another port (the agent reports the port as in conflict) and avoids no node.
PORT_IN_USE = "rendezvous port {} is in use"
_PORT_IN_USE = re.compile(r"^rendezvous port (\d{1,5}) is in use\b")


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


def port_in_use(why: str) -> int:
    """The rendezvous port a pre-flight's failure reason (`failure`'s answer) says was in
    use; 0 when the failure was anything else."""
    m = _PORT_IN_USE.match(why)
    port = int(m.group(1)) if m else 0
    return port if 0 < port < 65536 else 0
