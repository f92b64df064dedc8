"""An engine's requests in flight, read from its own /metrics: what tells the server a
draining replica is done (server/reconcile/drain.py).

vLLM: vllm:num_requests_running + vllm:num_requests_waiting; SGLang: num_running_reqs +
num_queue_reqs, prefixed `sglang:` or `sglang_` by version (../shared/notes/engines.md);
the simulated engine exposes vLLM's names. Names are matched exactly: vLLM's
num_requests_waiting_by_reason sums to the waiting figure and would count it twice.
Series with several label sets (vLLM's engine="0", "1" under data parallelism) are summed.

The agent reads it after each health probe that answered 200 and reports only a change
between none, some and unknown (`changed`): a busy engine stays busy without a message
per probe, and a zero it reported still holds until it says otherwise.
"""

from __future__ import annotations

import math

from llmgw.http1 import client
from llmgw.http1.client import NoAnswer

_NAMES = frozenset({
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "sglang:num_running_reqs", "sglang:num_queue_reqs",
    "sglang_num_running_reqs", "sglang_num_queue_reqs",
})
MAX_BODY_CHARS = 4 << 20  # a /metrics text past this is not read (not an engine's)


def parse_in_flight(text: str) -> int:
    """Running + waiting requests in Prometheus text; -1 when none of the names is there
    (or a figure is not a finite number: better unknown than a wrong zero)."""
    total = 0.0
    found = False
    for line in text[:MAX_BODY_CHARS].splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        if space < 0:
            continue
        end = brace if 0 <= brace < space else space
        if line[:end] not in _NAMES:
            continue
        rest = line[line.rfind("}") + 1:] if end == brace else line[end:]
        fields = rest.split()
        try:
            v = float(fields[0]) if fields else math.nan
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < 0:
            return -1
        total += v
        found = True
    return round(total) if found else -1


def _kind(n: int) -> int:
    return -1 if n < 0 else min(n, 1)


def changed(before: int, now: int) -> bool:
    """Whether a new count is worth a report: it moved between unknown, none and some."""
    return _kind(before) != _kind(now)


async def read_in_flight(host: str, port: int, *, timeout: float, key: str = "") -> int:
    """The engine's count now; -1 when /metrics does not answer 200 within `timeout`.
    `key`: the engine's own (vLLM's /metrics is behind llmgw's guard)."""
    headers = (("Authorization", f"Bearer {key}"),) if key else ()
    try:
        status, body = await client.request(host, port, "GET", "/metrics", timeout=timeout,
                                             headers=headers, user_agent="llmgw-agent")
    except NoAnswer:
        return -1
    if status != 200:
        return -1
    return parse_in_flight(body.decode("utf-8", "replace"))
