"""A hostile client against per-key limits (issue 24): 10,000 requests at once on a key
with `concurrency=4` (the engine slow to answer, so the four stay in flight), plus
garbage keys. The router stays up, answers every request (200 or 429 for the key, 401
for the garbage), and serves another key meanwhile. Real processes on loopback."""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from fakes.engines import free_port
from fakes.live import LLMGW, Cluster, Proc, wait_for
from llmgw.transport import keys

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out real windows: .ci/run -m live_long

DEPLOYMENT = """name: a
model: org/a
engine: simulated
gpus_per_node: 1
replicas: 1
env:
  LLMGW_SIM_TTFT: "1.5"
"""
FLOOD = 10_000


def request(secret: str) -> bytes:
    body = json.dumps({"model": "org/a", "prompt": "p", "max_tokens": 1}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
            % (secret.encode(), len(body), body))


async def one(port: int, req: bytes, out: list[int]) -> None:
    try:
        with trio.fail_after(60):
            s = await trio.open_tcp_stream("127.0.0.1", port)
            async with s:
                await s.send_all(req)
                buf = b""
                while b"\r\n" not in buf:
                    data = await s.receive_some(4096)
                    if not data:
                        break
                    buf += data
        out.append(int(buf.split(b" ", 2)[1]) if buf.startswith(b"HTTP/1.1 ") else -1)
    except (OSError, trio.TooSlowError, trio.BrokenResourceError):
        out.append(0)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_ten_thousand_at_once_on_a_concurrency_4_key(cluster: Cluster, tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 1000
    if hard < need:
        pytest.skip(f"needs {need} descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    c = cluster
    c.start_server()
    c.start_agent("n1", discovery={"simulated_gpus": 1})
    c.wait_states({"n1": "ready"})
    f = tmp_path / "a.yaml"
    f.write_text(DEPLOYMENT)
    assert c.ctl("apply", "-f", str(f)).returncode == 0

    def create(*args: str) -> str:
        r = c.ctl("apikey", "create", *args, "-o", "json")
        assert r.returncode == 0, r.stderr
        return str(json.loads(r.stdout)["secret"])
    four = create("four", "--concurrency", "4")
    other = create("other")
    port = free_port()
    keys.issue_key(str(c.keys_dir), "router", "r1")
    cfg = tmp_path / "router.toml"
    cfg.write_text(f'bind = "127.0.0.1:{port}"\nserver = "{c.address}"\n'
                   f'[keys]\nsecret_key = "{c.keys_dir / "r1.key_secret"}"\n'
                   f'server_key = "{c.server_key}"\n')
    router = Proc([*LLMGW, "router", "--config", str(cfg)], tmp_path / "router.log")
    c.procs.append(router)

    def served() -> bool:
        got: list[int] = []
        trio.run(one, port, request(other), got)
        return got == [200]
    wait_for(served, 60, "the router serving")

    flood: list[int] = []
    garbage: list[int] = []
    others: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            for i in range(FLOOD):
                n.start_soon(one, port, request(four), flood)
                if i % 1000 == 0:
                    n.start_soon(one, port, request("llmgw-" + "z" * 43), garbage)
                    await trio.lowlevel.checkpoint()
            # Meanwhile, another key is served.
            for _ in range(3):
                await one(port, request(other), others)

    t0 = time.monotonic()
    trio.run(main)
    took = time.monotonic() - t0
    assert router.p.poll() is None, router.text()[-2000:]
    counts = {code: flood.count(code) for code in set(flood)}
    print(f"{FLOOD} at once on concurrency=4: {counts} in {took:.1f}s")
    assert set(flood) <= {200, 429}, counts  # every one answered, none failed
    assert counts.get(429, 0) > FLOOD // 2 and counts.get(200, 0) >= 4
    assert set(garbage) == {401}
    assert others == [200, 200, 200]
    assert served()
