"""What the agent reports of an engine's collective pre-flight: its phase and figures,
from the result the launcher writes to the engine's folder (agent/insession/preflight_run.py).

The supervisor says RUNNING from the spawn of an engine whose plan carries a probe until
the result file is there, then that file's line ("passed: ..." or "failed: ...") and, for
a passed probe, its bus bandwidth. Parsing is pure (text in, figures out); only
`read_result` touches the file.
"""

from __future__ import annotations

import json
import os

from attrs import frozen

from llmgw.agent.engines.preflight import PORT_FAULT, RESULT_FILE, settings_of
from llmgw.model.engine import PREFLIGHT_RUNNING as RUNNING
from llmgw.model.engine import EngineSpec

__all__ = ["RUNNING", "Reported", "parse_result", "read_result", "result_path"]
LINE_MAX = 200


@frozen
class Reported:
    line: str  # EngineReport.preflight
    busbw_gbps: float = 0.0  # EngineReport.preflight_busbw_gbps
    # The rendezvous port the probe found taken (a port fault): EngineReport.conflict_port,
    # so that the server places the replica again on another port; 0: none.
    port: int = 0


def result_path(folder: str, spec: EngineSpec) -> str:
    """Where this engine's launcher writes the probe's result; "" when its plan carries
    none (the rule of engines/preflight.settings_of: a gang of more than one node, or
    one node's several GPUs, that asks for one)."""
    if settings_of(spec) is None:
        return ""
    return os.path.join(folder, RESULT_FILE)


def parse_result(text: str) -> Reported:
    """The reported line and figure from preflight.json's text; a file that cannot be read
    as the launcher's is a failure saying so, never an exception."""
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        line = doc.get("line")
        if not isinstance(line, str) or not line:
            raise ValueError("no line")
    except ValueError as exc:
        return Reported(f"failed: unreadable result ({exc})")
    line = "".join(c if c.isprintable() else "?" for c in line[:LINE_MAX])
    port = doc.get("port")
    if (doc.get("ok") is not True and doc.get("fault") == PORT_FAULT and isinstance(port, int)
            and not isinstance(port, bool) and 0 < port < 65536):
        return Reported(line, port=port)
    busbw = 0.0
    if doc.get("ok") is True:
        sizes = [r for r in doc.get("results") or () if isinstance(r, dict)
                 and isinstance(r.get("bytes"), int) and isinstance(r.get("busbw_gbps"), int | float)]
        if sizes:
            busbw = float(max(sizes, key=lambda r: r["bytes"])["busbw_gbps"])
    return Reported(line, busbw)


def read_result(path: str) -> Reported | None:
    """The result at `path`; None while there is none (the probe still runs)."""
    try:
        with open(path, errors="replace") as f:
            text = f.read(65536)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Reported(f"failed: cannot read {RESULT_FILE}: {exc}"[:LINE_MAX])
    return parse_result(text)
