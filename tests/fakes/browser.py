"""Headless Chromium driven over W3C WebDriver (Debian's chromium-driver), in plain JSON
over urllib: no selenium, nothing downloaded. Every process is stopped by pid on close.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fakes.engines import free_port

CHROMIUM = "/usr/lib/chromium/chromium" if os.path.exists("/usr/lib/chromium/chromium") else "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MISSING = "needs headless Chromium: apt-get install chromium chromium-driver"

# Nothing from the network: no updates, sync, safe-browsing lookups or QUIC probes.
ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
    "--no-first-run", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--disable-extensions", "--disable-default-apps", "--metrics-recording-only",
    "--no-default-browser-check", "--window-size=1400,1000",
]


def available() -> bool:
    return os.path.exists(CHROMIUM) and shutil.which(CHROMEDRIVER) is not None


class Browser:
    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="llmgw-chromium-")
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={self.port}"], stdout=self._log,
                                       stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        self.session = ""
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    if self._call("GET", "/status")["value"].get("ready"):
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline or self.driver.poll() is not None:
                    raise AssertionError("chromedriver did not start")
                time.sleep(0.1)
            caps = {"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": CHROMIUM,
                                       "args": [*ARGS, f"--user-data-dir={self.profile}"]},
            }}}
            self.session = self._call("POST", "/session", caps)["value"]["sessionId"]
        except BaseException:
            self.close()
            raise

    def _call(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"webdriver {method} {path}: {exc.code} {exc.read()[:500]!r}") from None

    def get(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def js(self, script: str, *args: Any) -> Any:
        """Run `script` (a function body) in the page; its `return` value comes back."""
        return self._call("POST", f"/session/{self.session}/execute/sync",
                          {"script": script, "args": list(args)})["value"]

    def close(self) -> None:
        if self.session:
            try:
                self._call("DELETE", f"/session/{self.session}", timeout=10)
            except (OSError, AssertionError):
                pass  # the driver is stopped below either way, and the browser with it
            self.session = ""
        if self.driver.poll() is None:
            self.driver.terminate()
            try:
                self.driver.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.driver.kill()
                self.driver.wait(timeout=5)
        self._log.close()
        _kill_by_profile(self.profile)
        shutil.rmtree(self.profile, ignore_errors=True)


def _kill_by_profile(profile: str) -> None:
    """Safety net: SIGKILL, by pid, any Chromium process still running on our profile."""
    needle = f"--user-data-dir={profile}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
            os.kill(int(entry), signal.SIGKILL)
        except OSError:
            continue
