"""The status page in a real browser (headless Chromium over WebDriver) against a running
server, two agents and simulated engines: it finds the nodes and replicas, and follows a
replica's state as it changes, without a reload."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from fakes.browser import MISSING, Browser, available
from fakes.engines import free_port
from fakes.live import Cluster, engine_pids, wait_for
from fakes.nvidia_smi import nvlink_board

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not available(), reason=MISSING)]

TOKEN = "page-token-0123456789abcdef"
WEB = Path(__file__).resolve().parents[2] / "src" / "llmgw" / "server" / "web"

ROWS = """
const out = {};
for (const tr of document.querySelectorAll(arguments[0])) {
  const state = tr.querySelector('[data-field=state]');
  out[tr.getAttribute(arguments[1])] = {
    state: state ? state.textContent : '',
    text: tr.textContent,
  };
}
return out;
"""


def test_the_page_follows_the_cluster(tmp_path: Path, browser: Browser) -> None:
    port = free_port()
    c = Cluster(tmp_path, extra_server=f'metrics_bind = "127.0.0.1:{port}"\nmetrics_token = "{TOKEN}"\n')
    try:
        c.start_server()
        c.start_agent("gpu-a", discovery={"nvidia_smi": str(nvlink_board(tmp_path / "smi"))})
        c.start_agent("gpu-b", discovery={"simulated_gpus": 2})
        c.wait_states({"gpu-a": "ready", "gpu-b": "ready"})
        dep = tmp_path / "chat.yaml"
        dep.write_text("name: chat\nmodel: org/chat\nengine: simulated\ngpus_per_node: 2\nreplicas: 1\n")
        assert c.ctl("apply", "-f", str(dep)).returncode == 0

        browser.get(f"http://127.0.0.1:{port}/?token={TOKEN}")

        def nodes() -> dict[str, dict[str, str]]:
            return browser.js(ROWS, "#nodes tr[data-node]", "data-node")  # type: ignore[no-any-return]

        def replicas() -> dict[str, dict[str, str]]:
            return browser.js(ROWS, "#replicas tr[data-replica]", "data-replica")  # type: ignore[no-any-return]

        wait_for(lambda: set(nodes()) == {"gpu-a", "gpu-b"}, 20, "both nodes on the page")
        seen = nodes()
        assert seen["gpu-a"]["state"] == "ready" and seen["gpu-b"]["state"] == "ready"
        # GPUs with their NVLink groups: the HGX board is one group of eight.
        assert "{0,1,2,3,4,5,6,7}" in seen["gpu-a"]["text"], seen["gpu-a"]["text"]
        assert "llmgw simulated GPU" in seen["gpu-b"]["text"]
        # Healthy GPUs carry no state badge and no notes (unhealthy, held, releasing).
        for nid in ("gpu-a", "gpu-b"):
            assert not any(w in seen[nid]["text"] for w in ("unhealthy", "held by pid", "releasing")), seen[nid]
        wait_for(lambda: replicas().get("chat-0", {}).get("state") == "ready", 40, "chat-0 ready on the page")
        row = replicas()["chat-0"]["text"]
        endpoint = c.status()["replicas"][0]["endpoint"]
        assert endpoint and endpoint in row, row
        assert browser.js("return document.getElementById('conn').textContent") == "live"

        # A mark in the page: a reload would wipe it.
        browser.js("window.__llmgwTestMark = 'still here'; return null")

        # The engine dies: the page shows the replica leave ready, then come back.
        pid = next(p for p, tag in engine_pids(tmp_path).items() if tag.startswith("chat-0"))
        os.kill(pid, signal.SIGKILL)
        states: list[str] = []

        def back_after_a_change() -> bool:
            s = replicas().get("chat-0", {}).get("state", "")
            if not states or states[-1] != s:
                states.append(s)
            return len(states) > 2 and states[-1] == "ready"

        wait_for(back_after_a_change, 60, "chat-0 to leave ready and come back", interval=0.2)
        assert any(s not in ("ready", "") for s in states), states

        # Scaled up: a second replica row appears, by itself.
        assert c.ctl("scale", "chat", "--replicas", "2").returncode == 0
        wait_for(lambda: replicas().get("chat-1", {}).get("state") == "ready", 40, "chat-1 ready on the page")
        # The deployment row counts them.
        ready = browser.js("return document.querySelector('tr[data-deployment=chat] [data-field=ready]')"
                           ".textContent")
        assert ready == "2/2"
        assert browser.js("return window.__llmgwTestMark") == "still here"
    finally:
        c.close()


def test_the_page_needs_the_token(tmp_path: Path, browser: Browser) -> None:
    port = free_port()
    c = Cluster(tmp_path, extra_server=f'metrics_bind = "127.0.0.1:{port}"\nmetrics_token = "{TOKEN}"\n')
    try:
        c.start_server()
        browser.get(f"http://127.0.0.1:{port}/")
        assert "token is required" in browser.js("return document.body.textContent")
        browser.get(f"http://127.0.0.1:{port}/?token={TOKEN}")
        wait_for(lambda: browser.js("return document.getElementById('conn').textContent") == "live", 10,
                 "the page live with the token")
        # The empty cluster reads as such, not as an error.
        assert "no nodes have said Hello" in browser.js("return document.getElementById('nodes').textContent")
    finally:
        c.close()


def test_peer_text_is_never_markup() -> None:
    script = (WEB / "status.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink
