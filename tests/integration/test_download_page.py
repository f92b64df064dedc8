"""The status page shows a starting replica's download (issue 23) in a real browser
(headless Chromium over WebDriver): the bytes on disk under the replica's state, moving
as the download grows, without a reload. The download is the test's own writes into the
HF cache layout under the agent's download_dir (the simulated engine fetches nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes.browser import MISSING, Browser, available
from fakes.engines import free_port
from fakes.live import Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not available(), reason=MISSING)]

TOKEN = "page-token-0123456789abcdef"
DOWNLOAD = ("const e = document.querySelector('tr[data-replica=\"tiny-0\"] [data-field=download]');"
            "return e ? e.textContent : '';")


def test_the_page_shows_the_bytes_on_disk(tmp_path: Path, browser: Browser) -> None:
    port = free_port()
    dl = tmp_path / "dl"
    c = Cluster(tmp_path, extra_server=f'metrics_bind = "127.0.0.1:{port}"\nmetrics_token = "{TOKEN}"\n')
    try:
        c.start_server()
        c.start_agent("n1", discovery={"simulated_gpus": 1}, download_dir=str(dl))
        c.wait_states({"n1": "ready"})
        dep = tmp_path / "tiny.yaml"
        dep.write_text("name: tiny\nmodel: org/tiny\nengine: simulated\ngpus_per_node: 1\n"
                       "replicas: 1\nenv: {LLMGW_SIM_LOAD_SECONDS: '120'}\n")
        assert c.ctl("apply", "-f", str(dep)).returncode == 0
        blob = dl / "models--org--tiny" / "blobs" / "abc.incomplete"
        blob.parent.mkdir(parents=True)
        blob.write_bytes(b"x" * 3_000_000)
        browser.get(f"http://127.0.0.1:{port}/?token={TOKEN}")
        wait_for(lambda: browser.js(DOWNLOAD).startswith("downloading n1: 3.0 MB on disk"), 30,
                 "the download on the page")
        with blob.open("ab") as f:
            f.write(b"x" * 5_000_000)
        wait_for(lambda: browser.js(DOWNLOAD).startswith("downloading n1: 8.0 MB on disk"), 30,
                 "the page following the download")
    finally:
        c.close()
