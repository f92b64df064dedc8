"""Runs a multi-process launch plan inside one session: `python -m llmgw.agent.launcher PLAN`.

The supervisor spawns this in a new session; it starts the plan's earlier processes
(e.g. `ray start --head --block`) as its children, in the same session, then replaces
itself with the main process, so the recorded pid is the engine's own.

PLAN is a JSON file: {"pre": [{"argv": [...], "env": {...}, "cwd": ...}, ...],
"main": {...}, "pre_delay": seconds}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m llmgw.agent.launcher PLAN.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        plan = json.load(f)
    for proc in plan["pre"]:
        print(f"llmgw launcher: starting {' '.join(proc['argv'])}", flush=True)
        subprocess.Popen(proc["argv"], env=proc["env"], cwd=proc["cwd"] or None)
    # TODO: wait for the Ray cluster to count its nodes instead of a fixed delay.
    time.sleep(float(plan.get("pre_delay", 0.0)))
    main_proc = plan["main"]
    if main_proc["cwd"]:
        os.chdir(main_proc["cwd"])
    print(f"llmgw launcher: exec {' '.join(main_proc['argv'])}", flush=True)
    os.execvpe(main_proc["argv"][0], main_proc["argv"], main_proc["env"])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
