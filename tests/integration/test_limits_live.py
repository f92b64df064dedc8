"""Per-key rate limits exact across routers (issue 24): a server, an agent, a simulated
engine and three routers, real processes on loopback. One key at rpm=10; clients hammer
all three routers for 65 s: at most 10 requests are accepted in any minute, in total
(LiteLLM's proxy lets through rpm × replicas here), the rest get 429 with Retry-After
and an OpenAI-shaped `rate_limit_exceeded`; a key without limits is served meanwhile."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

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
HAMMER = 65.0  # seconds


def post(port: int, secret: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "org/a", "prompt": "p", "max_tokens": 2}),
            {"content-type": "application/json", "authorization": f"Bearer {secret}"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    except OSError as exc:
        return 0, {}, str(exc).encode()
    finally:
        conn.close()


class Rig:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.c = Cluster(root)
        self.ports = [free_port() for _ in range(3)]

    def ok(self, *args: str) -> str:
        r = self.c.ctl(*args)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def start(self) -> tuple[str, str]:
        self.c.start_server()
        self.c.start_agent("n1", discovery={"simulated_gpus": 1})
        self.c.wait_states({"n1": "ready"})
        f = self.root / "a.yaml"
        f.write_text(DEPLOYMENT)
        self.ok("apply", "-f", str(f))
        limited = str(json.loads(self.ok("apikey", "create", "ten", "--rpm", "10", "-o", "json"))["secret"])
        free = str(json.loads(self.ok("apikey", "create", "free", "-o", "json"))["secret"])
        for i, port in enumerate(self.ports):
            keys.issue_key(str(self.c.keys_dir), "router", f"r{i}")
            cfg = self.root / f"router{i}.toml"
            cfg.write_text(f'bind = "127.0.0.1:{port}"\nserver = "{self.c.address}"\n'
                           f'[keys]\nsecret_key = "{self.c.keys_dir / f"r{i}.key_secret"}"\n'
                           f'server_key = "{self.c.server_key}"\n')
            self.c.procs.append(Proc([*LLMGW, "router", "--config", str(cfg)],
                                     self.root / f"router{i}.log"))
        for port in self.ports:  # served, through the key without limits
            wait_for(lambda p=port: post(p, free)[0] == 200, 60, f"router on {port}")  # type: ignore[misc]
        return limited, free


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.c.close()


def test_rpm_holds_across_three_routers(rig: Rig) -> None:
    limited, free = rig.start()
    results: list[tuple[float, float, int, dict[str, str], bytes]] = []
    lock = threading.Lock()
    end = time.monotonic() + HAMMER

    def client(port: int) -> None:
        while time.monotonic() < end:
            sent = time.monotonic()
            code, headers, body = post(port, limited)
            with lock:
                results.append((sent, time.monotonic(), code, headers, body))
            time.sleep(0.1)

    threads = [threading.Thread(target=client, args=(p,)) for p in rig.ports for _ in range(2)]
    for t in threads:
        t.start()
    try:
        # Other keys are served meanwhile.
        time.sleep(5)
        assert post(rig.ports[0], free)[0] == 200
    finally:
        for t in threads:
            t.join()
    codes = [r[2] for r in results]
    assert set(codes) <= {200, 429}, sorted(set(codes))
    assert len(results) > 200  # they did hammer
    ok = [r for r in results if r[2] == 200]
    # Accepted between sending and answering: every window checked on both ends.
    for at in (0, 1):
        times = sorted(r[at] for r in ok)
        worst = max(sum(1 for t in times if a <= t < a + 60) for a in times)
        assert worst <= 10, f"{worst} accepted in a minute"
    assert len(ok) >= 10, f"only {len(ok)} accepted: the limit was not used"
    refused = next(r for r in results if r[2] == 429)
    assert int(refused[3]["retry-after"]) >= 1
    err = json.loads(refused[4])["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests", err
    print(f"{len(results)} requests through 3 routers, {len(ok)} accepted in {HAMMER:g}s")
