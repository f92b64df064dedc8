"""A hostile client against per-key limits (issue 24): 10,000 requests at once on a key
with `concurrency=4` (the engine slow to answer, so the four stay in flight), plus
garbage keys. The router stays up, answers every request (200 or 429 for the key, 401
for the garbage), and serves another key meanwhile. Real processes on loopback."""

from __future__ import annotations

import json
import resource
import time

import pytest
import trio
import trio.lowlevel

from fakes.live import Cluster, simulated, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out real windows: .ci/run -m live_long

DEPLOYMENT = simulated("a", extra='env:\n  LLMGW_SIM_TTFT: "1.5"\n')
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


def test_ten_thousand_at_once_on_a_concurrency_4_key(cluster: Cluster) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 1000
    if hard < need:
        pytest.skip(f"needs {need} descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    c = cluster
    c.up({"n1": {"discovery": {"simulated_gpus": 1}}})
    c.apply("a", DEPLOYMENT)
    four = c.apikey("four", "--concurrency", "4")
    other = c.apikey("other")
    router, port = c.start_router()

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
