"""API keys and usage in front of a real vLLM (issue 24): llmgw's processes (server, agent,
router with the server's keys) and vLLM's CPU build serving the tiny Llama with
`--enable-prompt-tokens-details`, so that its `usage` carries `prompt_tokens_details` as
an object, as a production engine with prefix caching reports it.

What is checked against the engine itself: the router reads every answer's usage (plain
chat and completions, streams with and without `stream_options.include_usage`), strips the
usage event from a stream whose client did not ask for it, and `ctl usage` then totals
exactly what vLLM counted (its own `vllm:prompt_tokens_total` and
`vllm:generation_tokens_total`). Every process started here is killed by pid at the end.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes.engine_keys import auth, url_key
from fakes.live import Cluster, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.vllm_rig import DTYPE, READY_TIMEOUT, engine_log, tiny_yaml, vllm_agent
from fakes.web import events, post, series

pytestmark = pytest.mark.real_engine

MODEL = "tiny"
ENGINE_ARGS = ["--max-model-len", "512", "--enforce-eager", *DTYPE, "--enable-prompt-tokens-details"]
CHAT = "/v1/chat/completions"




@pytest.fixture(scope="module")
def served(vllm_venv: Path, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, int, str]]:
    """The cluster, its router's port and the key's secret, vLLM ready behind it."""
    root = tmp_path_factory.mktemp("vllm-usage")
    c = Cluster(root, heartbeat="1s", lost_after="60s")
    try:
        c.start_server()
        c.start_agent("cpu-1", **vllm_agent(vllm_venv, pcie_box(root / "smi")))
        c.wait_states({"cpu-1": "ready"})
        secret = c.apikey("k")
        _, port = c.start_router("edge", extra='usage_report_interval = "500ms"\n')
        c.apply("tiny", tiny_yaml(model=str(tiny_model), args=ENGINE_ARGS,
                                  extra=f"served_name: {MODEL}\n"))
        t0 = time.monotonic()

        def ready() -> bool:
            rep = next(iter(c.replicas().values()), {})
            return rep.get("state") == "ready"
        wait_for(ready, READY_TIMEOUT, f"vLLM replica ready (log: {engine_log(root)})", interval=1.0)
        print(f"vLLM ready under the agent in {time.monotonic() - t0:.0f}s")
        probe = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        wait_for(lambda: post(port, probe, secret, timeout=60)[0] == 200, 30, "router serving tiny")
        yield c, port, secret
    finally:
        c.close()


def test_usage_with_prompt_token_details_is_metered_as_vllm_counts_it(
        served: tuple[Cluster, int, str]) -> None:
    c, port, secret = served
    for i in range(3):
        prompt = "the quick brown fox " * (i + 1)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 3 + i, "temperature": 0}
        code, _, raw = post(port, chat, secret, timeout=120, path=CHAT)
        assert code == 200, raw
        usage = json.loads(raw)["usage"]
        # The case under test: details as an object, not null.
        assert isinstance(usage.get("prompt_tokens_details"), dict), usage
        comp = {"model": MODEL, "prompt": prompt, "max_tokens": 2 + i, "temperature": 0}
        code, _, raw = post(port, comp, secret, timeout=120)
        assert code == 200, raw
        asked = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        code, _, raw = post(port, asked, secret, timeout=120, path=CHAT)
        assert code == 200, raw
        last = events(raw)[-1]
        assert last["choices"] == [] and isinstance(last["usage"]["prompt_tokens_details"], dict), last
        code, _, raw = post(port, {**chat, "stream": True}, secret, timeout=120, path=CHAT)
        assert code == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
        assert all(e.get("usage") is None for e in events(raw)), "a usage event the client did not ask for"

    endpoint = str(next(iter(c.replicas().values()))["endpoint"])
    req = urllib.request.Request(endpoint + "/metrics", headers=auth(url_key(endpoint)))
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    want = {"prompt_tokens": int(series(text, "vllm:prompt_tokens_total")),
            "completion_tokens": int(series(text, "vllm:generation_tokens_total"))}
    assert want["completion_tokens"] > 0

    def totals() -> dict[str, int]:
        got = {"prompt_tokens": 0, "completion_tokens": 0}
        for row in json.loads(c.ok("usage", "--api-key", "k", "-o", "json")):
            if row["model"] == MODEL:
                for f in got:
                    got[f] += row[f]
        return got
    # Every request that reached the engine went through the router with the key: what
    # the router metered is what vLLM counted, once its last report is in.
    try:
        wait_for(lambda: totals() == want, 15, "usage totals equal to vLLM's counters")
    except AssertionError:
        raise AssertionError(f"ctl usage {totals()} != vLLM's counters {want}") from None
