"""A replica that leaves the router's table (a drain, issue 20 item 2) keeps the streams it
has and gets nothing new: the table's change cancels no request in flight."""

from __future__ import annotations

import re
from pathlib import Path

import trio
from test_router import Source, engine, start_router, table
from test_router_burst import metrics_text, stream_once

TOKENS = 30  # at 20 tokens a second: 1.5 s a stream


def generated(text: str) -> float:
    m = re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


async def test_removed_replica_finishes_its_streams_and_gets_nothing_new(tmp_path: Path,
                                                                       nursery: trio.Nursery) -> None:
    slow = {"LLMGW_SIM_TOKENS_PER_SECOND": "20", "LLMGW_SIM_TOKENS": "1000"}
    leaving, staying = engine(tmp_path, **slow), engine(tmp_path, **slow)
    try:
        leaving.wait_healthy()
        staying.wait_healthy()
        source = Source(table([leaving]))
        url = await start_router(nursery, source)
        results: list[dict[str, object]] = []

        async def one() -> None:
            results.append(await stream_once(url, TOKENS))

        async with trio.open_nursery() as streams:
            for _ in range(10):
                streams.start_soon(one)
            await trio.sleep(0.4)  # every stream under way on `leaving`
            v2 = table([staying], version=2)
            v2["models"]["sim"][0]["replica_id"] = "r1"
            source.snap = v2
            await trio.sleep(0.3)  # polled every 50 ms
            for _ in range(5):  # new requests, while the old streams still run
                got = await stream_once(url, 3)
                assert got.get("done"), got
            assert len(results) < 10  # the old streams were still running meanwhile
        assert [r.get("done") for r in results] == [True] * 10, results
        # Every token `leaving` made is one of the ten old streams'; the new ones all went
        # to `staying`.
        assert generated(await metrics_text(leaving.url)) == 10 * TOKENS
        assert generated(await metrics_text(staying.url)) == 5 * 3
    finally:
        leaving.stop()
        staying.stop()
