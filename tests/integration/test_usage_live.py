"""Usage per API key × model end to end (issue 24): a server, an agent, a simulated engine
and two routers, real processes on loopback. Plain and streamed completions (streams with
and without `stream_options.include_usage`) go through both routers; `ctl usage` then
totals exactly what the engine's `usage` fields say. A stream whose client did not ask
for usage gets no usage event (the router asked the engine and stripped it). The second
router reports only every 60 s and is stopped with SIGTERM before that: its last batch
goes as it stops, so nothing is lost."""

from __future__ import annotations

import http.client
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.engines import free_port
from fakes.live import LLMGW, Cluster, Proc, wait_for
from llmgw.transport import keys

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out real windows: .ci/run -m live_long

DEPLOYMENT = """name: a
model: org/a
engine: simulated
gpus_per_node: 1
replicas: 1
"""


def post(port: int, body: dict[str, Any], secret: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"content-type": "application/json", "authorization": f"Bearer {secret}"})
        r = conn.getresponse()
        return r.status, r.read()
    except OSError as exc:
        return 0, str(exc).encode()
    finally:
        conn.close()


def events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[len("data: "):]))
    return out


class Rig:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.c = Cluster(root)
        self.ports = [free_port(), free_port()]
        self.routers: list[Proc] = []

    def ok(self, *args: str) -> str:
        r = self.c.ctl(*args)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def start(self) -> str:
        self.c.start_server()
        self.c.start_agent("n1", discovery={"simulated_gpus": 1})
        self.c.wait_states({"n1": "ready"})
        f = self.root / "a.yaml"
        f.write_text(DEPLOYMENT)
        self.ok("apply", "-f", str(f))
        secret = str(json.loads(self.ok("apikey", "create", "k", "-o", "json"))["secret"])
        for i, (port, every) in enumerate(zip(self.ports, ("500ms", "60s"), strict=True)):
            keys.issue_key(str(self.c.keys_dir), "router", f"r{i}")
            cfg = self.root / f"router{i}.toml"
            cfg.write_text(f'bind = "127.0.0.1:{port}"\nserver = "{self.c.address}"\n'
                           f'usage_report_interval = "{every}"\n'
                           f'[keys]\nsecret_key = "{self.c.keys_dir / f"r{i}.key_secret"}"\n'
                           f'server_key = "{self.c.server_key}"\n')
            p = Proc([*LLMGW, "router", "--config", str(cfg)], self.root / f"router{i}.log")
            self.c.procs.append(p)
            self.routers.append(p)
        return secret


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.c.close()


def test_usage_totals_equal_the_engines_across_two_routers(rig: Rig) -> None:
    secret = rig.start()
    probe = {"model": "org/a", "prompt": "hello there", "max_tokens": 3}
    # Until both routers serve: these warm-up requests are counted too, so they are
    # counted here the same way.
    want = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def served(port: int) -> bool:
        code, raw = post(port, probe, secret)
        if code == 200:
            u = json.loads(raw)["usage"]
            want["requests"] += 1
            want["prompt_tokens"] += u["prompt_tokens"]
            want["completion_tokens"] += u["completion_tokens"]
        return code == 200
    for port in rig.ports:
        wait_for(lambda p=port: served(p), 60, f"router on {port} serving")  # type: ignore[misc]
    # Only 200s are compared below; the refusals while a router started are rows of
    # their own (other statuses).
    for port in rig.ports:
        for i in range(4):
            plain = {"model": "org/a", "prompt": "p" * (i + 1) * 10, "max_tokens": i + 2}
            code, raw = post(port, plain, secret)
            assert code == 200, raw
            u = json.loads(raw)["usage"]
            asked = {**plain, "stream": True, "stream_options": {"include_usage": True}}
            code, raw = post(port, asked, secret)
            assert code == 200, raw
            evs = events(raw)
            assert evs[-1]["choices"] == [] and evs[-1]["usage"] == u, evs[-1]
            code, raw = post(port, {**plain, "stream": True}, secret)
            assert code == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
            assert all("usage" not in e for e in events(raw)), "a usage event the client did not ask for"
            want["requests"] += 3
            want["prompt_tokens"] += 3 * u["prompt_tokens"]
            want["completion_tokens"] += 3 * u["completion_tokens"]
    # The second router reports every 60 s: its usage goes as it stops.
    assert rig.routers[1].stop(signal.SIGTERM) is not None

    def totals() -> dict[str, int]:
        rows = json.loads(rig.ok("usage", "--api-key", "k", "-o", "json"))
        got = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
        for r in rows:
            if r["status"] == 200 and r["model"] == "org/a":
                for f in got:
                    got[f] += r[f]
        return got
    try:
        wait_for(lambda: totals() == want, 10, "usage totals equal to the engine's", interval=0.3)
    except AssertionError:
        raise AssertionError(f"{totals()} != {want}\n{rig.routers[1].text()[-2000:]}") from None
    table = rig.ok("usage")
    assert "org/a" in table and str(want["requests"]) in table
    # The status document (and page) has them too, since the server started.
    row = next(u for u in rig.c.status()["usage"] if (u["api_key"], u["model"]) == ("k", "org/a"))
    assert row["requests"] >= want["requests"]  # refusals while a router started count too
    assert (row["prompt_tokens"], row["completion_tokens"]) == (want["prompt_tokens"],
                                                                want["completion_tokens"])


def test_a_killed_router_loses_at_most_its_unsent_interval(rig: Rig) -> None:
    secret = rig.start()
    port = rig.ports[0]  # reports every 500 ms
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
    rig.routers[0].stop(signal.SIGKILL)  # no time to send what the last interval counted

    def counted() -> int:
        rows = json.loads(rig.ok("usage", "--api-key", "k", "-o", "json"))
        return sum(r["requests"] for r in rows if r["status"] == 200)
    wait_for(lambda: counted() >= sent - last, 10, "the reported usage stored")
    time.sleep(1.0)
    n = counted()
    print(f"SIGKILL: {sent} sent, {n} counted, {sent - n} lost (at most the last interval's {last})")
    assert sent - last <= n <= sent
