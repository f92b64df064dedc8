"""Usage and keys across a server failover on PostgreSQL (issue 24): two servers on one
database, an agent, a simulated engine and a router that knows both servers, real
processes. Requests before and after the leader is SIGKILLed: `ctl usage` totals equal
what the engine's usage fields say, nothing counted twice (a batch retried on the new
leader carries its id) and nothing lost; the key table comes from the new leader (a key
revoked there is refused)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes.ha import HACluster
from fakes.live import simulated, wait_for
from fakes.web import post

pytestmark = [pytest.mark.slow, pytest.mark.failover]
BODY = {"model": "org/a", "prompt": "one two three", "max_tokens": 4}


@pytest.fixture
def ha(tmp_path: Path, pg_url: str) -> Iterator[HACluster]:
    c = HACluster(tmp_path, pg_url, lease="3s")
    try:
        yield c
    finally:
        c.close()


def test_usage_counted_once_across_a_failover(ha: HACluster) -> None:
    ha.start_server(0)
    first = ha.wait_leader()
    ha.start_server(1)
    ha.start_agent("n1", discovery={"simulated_gpus": 1})
    ha.wait_states({"n1": "ready"}, timeout=30)
    ha.apply("a", simulated("a"))
    secret, spare = ha.apikey("k"), ha.apikey("spare")
    _, port = ha.start_router(extra='usage_report_interval = "500ms"\n')  # knows both servers
    want = {"requests": 0, "tokens": 0}

    def ask(key: str = secret) -> int:
        r = post(port, BODY, key)
        code, body = r.status, r.json()
        if code == 200 and key == secret:
            want["requests"] += 1
            want["tokens"] += body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        return code
    wait_for(lambda: ask() == 200, 60, "the router serving")
    for _ in range(20):
        assert ask() == 200
    ha.servers[first].stop(signal.SIGKILL)
    for _ in range(20):  # the router serves on through the failover (engines answer)
        assert ask() == 200
    ha.wait_leader(not_=first, timeout=30)
    for _ in range(20):
        assert ask() == 200

    def totals() -> dict[str, int]:
        r = ha.ctl("usage", "--api-key", "k", "-o", "json")
        if r.returncode != 0:
            return {}
        rows = [x for x in json.loads(r.stdout) if x["status"] == 200]
        return {"requests": sum(x["requests"] for x in rows),
                "tokens": sum(x["prompt_tokens"] + x["completion_tokens"] for x in rows)}
    try:
        wait_for(lambda: totals() == want, 30, "usage totals equal to the engine's", interval=0.5)
    except AssertionError:
        raise AssertionError(f"{totals()} != {want}") from None
    # The key table comes from the new leader.
    assert ha.ctl("apikey", "revoke", "spare").returncode == 0
    wait_for(lambda: ask(spare) == 401, 5, "a key revoked on the new leader refused")
    assert ask() == 200
