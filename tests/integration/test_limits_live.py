"""Per-key rate limits exact across routers (issue 24): a server, an agent, a simulated
engine and three routers, real processes on loopback. One key at rpm=10; clients hammer
all three routers for 65 s: at most 10 requests are accepted in any minute, in total
(LiteLLM's proxy lets through rpm × replicas here), the rest get 429 with Retry-After
and an OpenAI-shaped `rate_limit_exceeded`; a key without limits is served meanwhile."""

from __future__ import annotations

import json
import threading
import time

import pytest

from fakes.live import Cluster, simulated, wait_for
from fakes.web import Reply, post

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out real windows: .ci/run -m live_long

HAMMER = 65.0  # seconds
BODY = {"model": "org/a", "prompt": "p", "max_tokens": 2}


def start(c: Cluster) -> tuple[str, str, list[int]]:
    """One replica, a key at rpm=10 and one without limits, three routers serving."""
    c.up({"n1": {"discovery": {"simulated_gpus": 1}}})
    c.apply("a", simulated("a"))
    limited = c.apikey("ten", "--rpm", "10")
    free = c.apikey("free")
    ports = [c.start_router(f"r{i}")[1] for i in range(3)]
    for port in ports:  # served, through the key without limits
        wait_for(lambda p=port: post(p, BODY, free)[0] == 200, 60, f"router on {port}")  # type: ignore[misc]
    return limited, free, ports


def test_rpm_holds_across_three_routers(cluster: Cluster) -> None:
    limited, free, ports = start(cluster)
    results: list[tuple[float, float, Reply]] = []
    lock = threading.Lock()
    end = time.monotonic() + HAMMER

    def client(port: int) -> None:
        while time.monotonic() < end:
            sent = time.monotonic()
            reply = post(port, BODY, limited)
            with lock:
                results.append((sent, time.monotonic(), reply))
            time.sleep(0.1)

    threads = [threading.Thread(target=client, args=(p,)) for p in ports for _ in range(2)]
    for t in threads:
        t.start()
    try:
        # Other keys are served meanwhile.
        time.sleep(5)
        assert post(ports[0], BODY, free)[0] == 200
    finally:
        for t in threads:
            t.join()
    codes = [r[2].status for r in results]
    assert set(codes) <= {200, 429}, [(r[2].status, r[2].body[:300]) for r in results
                                      if r[2].status not in (200, 429)][:3]
    assert len(results) > 200  # they did hammer
    ok = [r for r in results if r[2].status == 200]
    # Accepted between sending and answering: every window checked on both ends.
    for at in (0, 1):
        times = sorted(r[at] for r in ok)
        worst = max(sum(1 for t in times if a <= t < a + 60) for a in times)
        assert worst <= 10, f"{worst} accepted in a minute"
    assert len(ok) >= 10, f"only {len(ok)} accepted: the limit was not used"
    refused = next(r[2] for r in results if r[2].status == 429)
    assert int(refused.headers["retry-after"]) >= 1
    err = json.loads(refused.body)["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests", err
    print(f"{len(results)} requests through 3 routers, {len(ok)} accepted in {HAMMER:g}s")
