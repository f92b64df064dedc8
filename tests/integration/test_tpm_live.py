"""Tokens per minute end to end (issue 24): a server, an agent, a simulated engine and
two routers, real processes on loopback. One key at tpm=600; plain and streamed answers
through both routers for 20 s: the tokens the engine reports for the accepted answers
stay within 600 (all within one minute), while requests go on being accepted until the
limit is near; a request whose max_tokens alone is over the limit is refused up front."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from fakes.live import Cluster, simulated, wait_for
from fakes.web import post

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out real windows: .ci/run -m live_long

TPM = 600


def test_tpm_plain_and_streamed(cluster: Cluster) -> None:
    c = cluster
    c.up({"n1": {"discovery": {"simulated_gpus": 1}}})
    c.apply("a", simulated("a"))
    secret = c.apikey("t", "--tpm", str(TPM))
    ports = [c.start_router(f"r{i}")[1] for i in range(2)]
    # Over the limit on its own: refused at once, before any engine sees it. Until each
    # router has the key and a ready replica the answer is 401 or 503, which spends
    # nothing, so the same request is the probe.
    big = {"model": "org/a", "prompt": "p", "max_tokens": 100_000}
    for port in ports:
        wait_for(lambda p=port: post(p, big, secret)[0] == 429, 60,  # type: ignore[misc]
                 f"router on {port} with the key and a ready replica")
    t0 = time.monotonic()
    code, _, raw = post(ports[0], big, secret)
    assert code == 429 and time.monotonic() - t0 < 1.0, raw
    err = json.loads(raw)["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "tokens", err

    used = 0
    accepted = refused = 0
    end = time.monotonic() + 20
    i = 0
    while time.monotonic() < end:
        i += 1
        body: dict[str, Any] = {"model": "org/a", "prompt": "hello " * 5, "max_tokens": 20}
        if i % 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        code, _, raw = post(ports[i % 2], body, secret)
        if code == 429:
            refused += 1
            continue
        assert code == 200, raw
        accepted += 1
        if i % 2:
            events = [json.loads(b[6:]) for b in raw.split(b"\n\n")
                      if b.startswith(b"data: {")]
            u = events[-1]["usage"]
        else:
            u = json.loads(raw)["usage"]
        used += u["prompt_tokens"] + u["completion_tokens"]
    print(f"tpm={TPM}: {accepted} accepted ({used} tokens by the engine's usage), {refused} refused")
    assert used <= TPM
    assert accepted >= 5 and refused > 0
