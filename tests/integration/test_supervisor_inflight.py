"""The agent's in-flight reports (what ends a drain early, issue 20 item 2): a real
simulated engine under the supervisor reports none, then some while a request runs, then
none again, and nothing more while the count only changes within "some"."""

from __future__ import annotations

from pathlib import Path

import trio
from test_supervisor import _kill_tagged, spec

from fakes.engines import free_port
from fakes.supervision import Reports, chat
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.model.engine import EngineReport


async def _flight(reports: Reports, rid: str, want: int, timeout: float = 10) -> EngineReport:
    """The first report of `rid` at or after now whose count is `want` (-1, 0, or any >0: 1)."""
    start = len(reports.seen)
    with trio.fail_after(timeout):
        while True:
            for r in reports.seen[start:]:
                if r.replica_id == rid and (r.in_flight == want or (want == 1 and r.in_flight > 0)):
                    return r
            await trio.sleep(0.02)


async def test_in_flight_reported_between_none_and_some(tmp_path: Path) -> None:
    rid = "tinflight-0"
    # 20 tokens at 10 a second: each chat runs about 2 s, across several 0.2 s probes.
    s = spec(rid, free_port(), LLMGW_SIM_TOKENS_PER_SECOND="10", LLMGW_SIM_TOKENS="20")
    reports = Reports()
    sup = Supervisor(config(str(tmp_path)), reports)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            await sup.apply((s,))
            await _flight(reports, rid, 0)  # ready, then the first read: idle
            async with trio.open_nursery() as chats:
                for _ in range(3):
                    chats.start_soon(trio.to_thread.run_sync, chat, s.port, s.served_name)
                busy = await _flight(reports, rid, 1)
                mark = len(reports.seen)
            # While busy the count went 1, 2, 3 and back: one report, not one per change.
            assert [r.in_flight for r in reports.seen[mark:] if r.replica_id == rid] in ([], [0])
            idle = await _flight(reports, rid, 0)
            assert busy.in_flight >= 1 and idle.state == busy.state
            # What a Hello carries says so too.
            assert [r.in_flight for r in sup.reports() if r.replica_id == rid] == [0]
            await sup.apply(())
            nursery.cancel_scope.cancel()
    finally:
        _kill_tagged("tinflight-")
