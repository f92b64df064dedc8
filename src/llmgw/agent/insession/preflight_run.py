"""Running the pre-flight probe inside the engine's session, before the engine
(llmgw.agent.insession.launcher calls `run` first when the plan carries one).

The probe's output goes on to the engine's log; its result, judged by
llmgw.agent.engines.preflight (the bus-bandwidth floor), is written to the engine's
folder (preflight.json) and said in one log line, `llmgw launcher: pre-flight passed:
gloo x2, 4 MiB at 1.15 GB/s bus bandwidth, in 2.0s` or `... pre-flight failed: <why>`,
which the server sees in the engine's log tail when the engine does not start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

from llmgw.agent.engines.preflight import (
    PORT_FAULT,
    PROBE_ENV,
    ProbeResult,
    floor_for,
    net_verdict,
    parse_output,
    result_doc,
    verdict,
)
from llmgw.model.preflight import FAILED_LINE

# Past the probe's own timeout (which bounds its rendezvous), this long for it to say
# so before it is killed.
GRACE = 10.0


def _say(text: str) -> None:
    print(f"llmgw launcher: {text}", flush=True)


def _settings(doc: dict[str, Any]) -> dict[str, Any]:
    """The probe's own settings (engines/preflight.probe_process put them in its env)."""
    try:
        got = json.loads((doc.get("env") or {}).get(PROBE_ENV) or "{}")
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def probe(doc: dict[str, Any]) -> ProbeResult:
    """Run the probe `doc` describes (plans.spawn_plan's "preflight"), bounded."""
    timeout = float(doc["timeout"])
    if not doc["argv"] or not doc["argv"][0]:
        # No Python was found for the engine (engines/preflight.preflight_for refuses a
        # required probe so; a best-effort one comes here and says it).
        return ProbeResult(False, "no Python was found to run the probe with (the engine's "
                                  "#! line names none that resolves); set engines.preflight_python")
    settings = _settings(doc)
    _say(f"pre-flight: {' '.join(doc['argv'])} (at most {timeout:g}s)")
    try:
        p = subprocess.Popen(doc["argv"], env=doc["env"], cwd=doc["cwd"] or None,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace", process_group=0)
    except OSError as exc:
        return ProbeResult(False, f"cannot start the probe: {exc}")
    try:
        out, _ = p.communicate(timeout=timeout + GRACE)
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            _say("pre-flight: the probe was gone before it could be killed")
        out, _ = p.communicate()
        timed_out = True
    sys.stdout.write(out)
    sys.stdout.flush()
    if timed_out:
        return ProbeResult(False, f"timed out after {timeout:g}s (a peer that never came, "
                                  "or a collective that hangs)")
    port = settings.get("master_port")
    result = parse_output(out, port if isinstance(port, int) else 0)
    if result.ok and p.returncode != 0:
        return ProbeResult(False, f"the probe exited {p.returncode}")
    hcas = settings.get("hcas")
    # Sockets before the floor: "NCCL used TCP sockets" says why the bandwidth is low.
    result = net_verdict(result, out, tuple(str(h) for h in hcas) if isinstance(hcas, list) else ())
    return verdict(result, floor_for(result, float(doc.get("min_busbw_gbps") or 0.0),
                                     float(doc.get("nccl_floor_gbps") or 0.0)))


def write_result(path: str, result: ProbeResult) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(result_doc(result), f)
        os.replace(tmp, path)
    except OSError as exc:
        _say(f"pre-flight: cannot write {path}: {exc}")


def run(doc: dict[str, Any]) -> bool:
    """Probe, record, say; True when the engine may start (passed, or best effort)."""
    result = probe(doc)
    write_result(str(doc.get("result") or ""), result)
    if result.ok:
        _say(f"pre-flight {result.line()}")
    else:
        # The server reads this line (and the exit code) as a pre-flight failure.
        print(f"{FAILED_LINE}{result.error}", flush=True)
    if result.ok:
        return True
    if result.fault == PORT_FAULT:
        # Whatever the mode: the engine would meet its peers on the same taken port. The
        # agent reports the port as in conflict and the server places the replica again
        # on another one.
        _say(f"pre-flight: port {result.port} is taken: the engine does not start")
        return False
    if doc.get("required", True):
        _say("pre-flight is required: the engine does not start")
        return False
    _say("pre-flight is best effort: the engine starts anyway")
    return True
