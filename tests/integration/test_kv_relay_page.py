"""The status page names each node's KV relay, where routers follow its engines' KV-cache
events, in a real browser (headless Chromium over WebDriver); a node without one shows none."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes.browser import MISSING, Browser, available
from fakes.engines import free_port
from fakes.live import Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not available(), reason=MISSING)]

TOKEN = "page-token-0123456789abcdef"
RELAY = ("const e = document.querySelector('tr[data-node=\"' + arguments[0] + '\"] [data-field=kv-relay]');"
         "return e ? e.textContent : null;")
ROW = "return document.querySelector('tr[data-node=\"' + arguments[0] + '\"]') !== null;"


def test_the_page_names_each_nodes_kv_relay(tmp_path: Path, browser: Browser) -> None:
    port, relay = free_port(), free_port()
    c = Cluster(tmp_path, extra_server=f'metrics_bind = "127.0.0.1:{port}"\nmetrics_token = "{TOKEN}"\n')
    try:
        c.up({"n1": {"kv_relay_port": relay}, "n2": {}})
        browser.get(f"http://127.0.0.1:{port}/?token={TOKEN}")
        wait_for(lambda: browser.js(RELAY, "n1") == f"KV relay tcp://127.0.0.1:{relay}", 30,
                 "n1's relay on the page")
        assert browser.js(ROW, "n2") and browser.js(RELAY, "n2") is None
    finally:
        c.close()
