"""A Supervisor in its own process, for tests that SIGKILL the agent.

python supervisor_proc.py WORK_DIR DESIRED.json
DESIRED.json: {"stop_timeout": s, "engines": [unstructured EngineSpec, ...]}.
Adopts what WORK_DIR records, applies the desired set, prints one line per report,
then runs until killed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import trio
from cattrs.preconf.json import make_converter

from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.config.agent import AgentConfig, KeysConfig, SupervisorConfig
from llmgw.model.engine import EngineReport, EngineSpec


def config(work_dir: str, stop_timeout: float = 2.0) -> AgentConfig:
    return AgentConfig(
        node_id="test-node", server="tcp://127.0.0.1:1", keys=KeysConfig("s", "p"),
        mgmt_addr="127.0.0.1",
        supervisor=SupervisorConfig(work_dir=work_dir, log_lines=20, stop_timeout=stop_timeout,
                                    health_interval=0.2),
    )  # fmt: skip


async def main(work_dir: str, doc: dict[str, Any]) -> None:
    specs = make_converter().structure(doc["engines"], tuple[EngineSpec, ...])

    def on_report(r: EngineReport) -> None:
        print(f"report {r.replica_id} {r.state} pid={r.pid} {r.reason}", flush=True)

    sup = Supervisor(config(work_dir, doc.get("stop_timeout", 2.0)), on_report)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        print("adopted", flush=True)
        await sup.apply(specs)
        print("applied", flush=True)


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        desired = json.load(f)
    trio.run(main, sys.argv[1], desired)
