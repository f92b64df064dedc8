"""Engine keys (issue 30) for tests that talk to an engine the agent started: every such
engine refuses what the agent and the routers do not send it with its own key.

`engine_key` finds it where the engine was given it, in its environment (VLLM_API_KEY:
vLLM and the simulated engine), by the process that listens on the port; `record_key`
reads it from the agent's record, as an adopting agent does."""

from __future__ import annotations

import json
from pathlib import Path

from llmgw.agent.process import ports


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


def engine_key(port: int, addr: str = "127.0.0.1") -> str:
    """The key of the engine listening on addr:port; "" when it has none (or none listens)."""
    for pid, _ in ports.taken_by(addr, port).holders:
        key = _environ(pid).get("VLLM_API_KEY", "")
        if key:
            return key
    return ""


def url_key(url: str) -> str:
    """engine_key of an endpoint URL, http://host:port."""
    host, _, port = url.split("://", 1)[-1].rstrip("/").rpartition(":")
    return engine_key(int(port), host)


def record_key(root: Path, replica_id: str) -> str:
    """The key in the agent's record of `replica_id`, anywhere under `root`."""
    (path,) = root.glob(f"**/engines/{replica_id}/record.json")
    return str(json.loads(path.read_text()).get("api_key", ""))


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}
