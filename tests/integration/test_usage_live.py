"""Usage per API key × model end to end (issue 24): a server, an agent, a simulated engine
and two routers, real processes on loopback. Plain and streamed completions (streams with
and without `stream_options.include_usage`) go through both routers; `ctl usage` then
totals exactly what the engine's `usage` fields say. A stream whose client did not ask
for usage gets no usage event (the router asked the engine and stripped it). The second
router reports only every 60 s and is stopped with SIGTERM before that: its last batch
goes as it stops, so nothing is lost."""

from __future__ import annotations

import json
import signal
import time

import pytest

from fakes.live import Cluster, Proc, simulated, wait_for
from fakes.web import events, post

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out real windows: .ci/run -m live_long



def start(c: Cluster) -> tuple[str, list[Proc], list[int]]:
    """One replica, one key and two routers: the first reports usage every 500 ms, the
    second every 60 s. Returns the key's secret, the routers and their ports."""
    c.up({"n1": {"discovery": {"simulated_gpus": 1}}})
    c.apply("a", simulated("a"))
    secret = c.apikey("k")
    routers = [c.start_router(f"r{i}", extra=f'usage_report_interval = "{every}"\n')
               for i, every in enumerate(("500ms", "60s"))]
    return secret, [p for p, _ in routers], [port for _, port in routers]


def test_usage_totals_equal_the_engines_across_two_routers(cluster: Cluster) -> None:
    secret, routers, ports = start(cluster)
    probe = {"model": "org/a", "prompt": "hello there", "max_tokens": 3}
    # Until both routers serve: these warm-up requests are counted too, so they are
    # counted here the same way.
    want = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def served(port: int) -> bool:
        code, _, raw = post(port, probe, secret)
        if code == 200:
            u = json.loads(raw)["usage"]
            want["requests"] += 1
            want["prompt_tokens"] += u["prompt_tokens"]
            want["completion_tokens"] += u["completion_tokens"]
        return code == 200
    for port in ports:
        wait_for(lambda p=port: served(p), 60, f"router on {port} serving")  # type: ignore[misc]
    # Only 200s are compared below; the refusals while a router started are rows of
    # their own (other statuses).
    for port in ports:
        for i in range(4):
            plain = {"model": "org/a", "prompt": "p" * (i + 1) * 10, "max_tokens": i + 2}
            code, _, raw = post(port, plain, secret)
            assert code == 200, raw
            u = json.loads(raw)["usage"]
            asked = {**plain, "stream": True, "stream_options": {"include_usage": True}}
            code, _, raw = post(port, asked, secret)
            assert code == 200, raw
            evs = events(raw)
            assert evs[-1]["choices"] == [] and evs[-1]["usage"] == u, evs[-1]
            code, _, raw = post(port, {**plain, "stream": True}, secret)
            assert code == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
            assert all("usage" not in e for e in events(raw)), "a usage event the client did not ask for"
            want["requests"] += 3
            want["prompt_tokens"] += 3 * u["prompt_tokens"]
            want["completion_tokens"] += 3 * u["completion_tokens"]
    # The second router reports every 60 s: its usage goes as it stops.
    assert routers[1].stop(signal.SIGTERM) is not None

    def totals() -> dict[str, int]:
        rows = json.loads(cluster.ok("usage", "--api-key", "k", "-o", "json"))
        got = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
        for r in rows:
            if r["status"] == 200 and r["model"] == "org/a":
                for f in got:
                    got[f] += r[f]
        return got
    try:
        wait_for(lambda: totals() == want, 10, "usage totals equal to the engine's", interval=0.3)
    except AssertionError:
        raise AssertionError(f"{totals()} != {want}\n{routers[1].text()[-2000:]}") from None
    table = cluster.ok("usage")
    assert "org/a" in table and str(want["requests"]) in table
    # The status document (and page) has them too, since the server started.
    row = next(u for u in cluster.status()["usage"] if (u["api_key"], u["model"]) == ("k", "org/a"))
    assert row["requests"] >= want["requests"]  # refusals while a router started count too
    assert (row["prompt_tokens"], row["completion_tokens"]) == (want["prompt_tokens"],
                                                                want["completion_tokens"])


def test_a_killed_router_loses_at_most_its_unsent_interval(cluster: Cluster) -> None:
    secret, routers, ports = start(cluster)
    port = ports[0]  # reports every 500 ms
    probe = {"model": "org/a", "prompt": "p", "max_tokens": 2}
    wait_for(lambda: post(port, probe, secret)[0] == 200, 60, "the router serving")
    sent = 1
    for _ in range(10):
        assert post(port, probe, secret)[0] == 200
        sent += 1
    time.sleep(1.5)  # reported
    last = 5
    for _ in range(last):
        assert post(port, probe, secret)[0] == 200
        sent += 1
    routers[0].stop(signal.SIGKILL)  # no time to send what the last interval counted

    def counted() -> int:
        rows = json.loads(cluster.ok("usage", "--api-key", "k", "-o", "json"))
        return sum(r["requests"] for r in rows if r["status"] == 200)
    wait_for(lambda: counted() >= sent - last, 10, "the reported usage stored")
    time.sleep(1.0)
    n = counted()
    print(f"SIGKILL: {sent} sent, {n} counted, {sent - n} lost (at most the last interval's {last})")
    assert sent - last <= n <= sent
