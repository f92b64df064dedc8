"""Usage per API key × model (API keys and limits), router side, pure: the tap that reads the
engine's `usage` from an answer as it is relayed, and the meter that adds it up and hands
out batches for the server.

The tap. A plain answer's `usage` object is near its end: the tap keeps the answer's last
TAIL bytes and reads it from there when the answer is done. A stream has it only when the
request asked (`stream_options.include_usage`): the router asks on every metered stream,
and when the client had not, strips that event (its `choices` is empty, which some
clients do not expect) from what the client gets. For that the tap reads the chunked
framing the engine sent (already checked by the relay's ChunkedReader): a chunk is held
until it is whole (an engine writes one event per chunk, so in practice nothing waits),
except one larger than HOLD_MAX, which goes on as it comes. An answer in another framing
(a client speaking HTTP/1.0) is only read, never changed.

The meter. Rows per (key, model, hour, status), merged as they come; `batch()` seals them
into a batch with an id and hands the same batch out again until `acked`, so that a batch
retried after a failover carries its id and is counted once (store.add_usage). What is
lost when a router dies is what it had not sent: at most one report interval.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmgw.http1.writers import chunk
from llmgw.model.usage import HOUR, UsageRow

TAIL = 4096  # bytes of a plain answer kept to find its usage in
HOLD_MAX = 65536  # a stream's chunk larger than this is not held whole
MAX_ROWS = 4000  # rows per batch (a message's lists hold at most 4096 items)
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
# The usage object as vLLM and SGLang write it (their UsageInfo: prompt_tokens,
# total_tokens, completion_tokens, then details; compact, or with json.dumps' spaces),
# read without parsing JSON: this runs on every metered answer (a few µs less than the
# parse). Anything else is parsed (`read_usage`). Digits only: a negative or fractional
# count is not read here.
_USUAL = re.compile(rb'"usage": ?\{"prompt_tokens": ?(\d{1,15}), ?"total_tokens": ?\d{1,15}, ?'
                    rb'"completion_tokens": ?(\d{1,15})[,}]')
# OpenAI's own order (prompt, completion, total), which other servers copy.
_OPENAI = re.compile(rb'"usage": ?\{"prompt_tokens": ?(\d{1,15}), ?"completion_tokens": ?'
                     rb'(\d{1,15}), ?"total_tokens": ?\d{1,15}[,}]')
_KEY = re.compile(rb'"usage"\s*:\s*')
_DECODER = json.JSONDecoder()


def _tokens(obj: Any) -> tuple[int, int] | None:
    if not isinstance(obj, dict):
        return None
    p, c = obj.get("prompt_tokens", 0), obj.get("completion_tokens", 0)
    if c is None:  # vLLM's completion_tokens may be null (an answer that completes nothing)
        c = 0
    if type(p) is not int or type(c) is not int or p < 0 or c < 0:
        return None
    return p, c


def read_usage(buf: bytes, at: int) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the usage object whose `"usage"` key starts at `at`
    in `buf`, or None. Its details may be objects (vLLM's `prompt_tokens_details` with
    --enable-prompt-tokens-details, SGLang's with --enable-cache-report, either's
    `completion_tokens_details`): what is not in the usual order is parsed as JSON, the
    object alone (bounded by `buf`)."""
    m = _USUAL.match(buf, at) or _OPENAI.match(buf, at)
    if m is not None:
        p, c = m.groups()
        return int(p), int(c)
    m = _KEY.match(buf, at)
    if m is None:
        return None
    try:
        obj, _ = _DECODER.raw_decode(buf[m.end():].decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    return _tokens(obj)


class UsageTap:
    """One answer's usage, read as it is relayed. `strip`: drop the usage event of a
    stream (the client did not ask for it)."""

    __slots__ = ("strip", "stream", "chunked", "prompt", "completion", "seen", "_tail", "_held",
                 "_pass")

    def __init__(self, stream: bool, strip: bool = False) -> None:
        self.stream = stream
        self.strip = strip
        self.chunked = False  # set by the relay when the engine's answer is chunked
        self.prompt = 0
        self.completion = 0
        self.seen = False  # a usage object was found
        self._tail = b""
        self._held = b""
        self._pass = 0  # bytes of an oversized chunk still to let through as they come

    def feed(self, data: bytes) -> bytes:
        """What to send on of `data` (the engine's bytes, as the relay would send them)."""
        if not (self.stream and self.chunked):
            tail = self._tail  # usually empty: a plain answer comes in one read
            self._tail = (tail + data)[-TAIL:] if tail else data[-TAIL:]
            return data
        return self._chunks(data)

    def _chunks(self, data: bytes) -> bytes:
        if not self._pass:
            buf = self._held + data if self._held else data
            if b'"usage"' not in buf:
                # No usage event (most reads): on as they are, up to the end of the last
                # whole chunk; the rest is held until whole. An event is `data: <JSON>\n\n`
                # and JSON holds no raw line break, so `\n\n\r\n` is a chunk's end.
                at = buf.rfind(b"\n\n\r\n")
                if at >= 0:
                    cut = at + 4
                    if cut == len(buf):
                        self._held = b""
                        return buf
                    if len(buf) - cut <= HOLD_MAX:
                        self._held = buf[cut:]
                        return buf[:cut]
        out = bytearray()
        if self._pass:
            take = min(self._pass, len(data))
            out += data[:take]
            self._pass -= take
            data = data[take:]
        buf = self._held + data if self._held else data
        # Walk the chunk heads only; the bytes from `start` go on as they are, up to a
        # chunk that holds a usage event (one a stream, in a read with many others).
        pos = start = 0
        n = len(buf)
        while pos < n:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            try:
                size = int(buf[pos:nl].split(b";", 1)[0], 16)
            except ValueError:  # the relay's reader checks the framing: not reached
                pos = n
                break
            end = nl + 2 + size + 2
            if end > n:
                if end - pos > HOLD_MAX:  # too big to hold: on as it comes
                    self._pass = end - n
                    pos = n
                break
            if buf.find(b'"usage"', nl + 2, end - 2) >= 0:
                kept = self._events(buf[nl + 2:end - 2])
                if kept is not None:  # the usage event taken out of the chunk
                    out += buf[start:pos]
                    out += chunk(kept)  # nothing when the usage event was alone in it
                    start = end
            pos = end
        out += buf[start:pos]
        self._held = buf[pos:]
        return bytes(out)

    def _events(self, payload: bytes) -> bytes | None:
        """Read the usage of a chunk's events; with `strip`, the chunk without its
        usage-only event (None: the chunk goes as it is). An engine may put several events
        in one chunk: only that event goes."""
        if b"\n\n" not in payload.rstrip(b"\n"):
            return b"" if self._event(payload) and self.strip else None
        events = payload.split(b"\n\n")
        kept = [e for e in events if not (b'"usage"' in e and self._event(e) and self.strip)]
        return None if len(kept) == len(events) else b"\n\n".join(kept)

    def _event(self, payload: bytes) -> bool:
        """Read a stream event's usage; True when it is the usage-only event."""
        got = read_usage(payload, payload.rfind(b'"usage"'))
        if got is None:
            return False
        self.prompt, self.completion = got
        self.seen = True
        return _EMPTY_CHOICES.search(payload) is not None

    def done(self) -> None:
        """The answer is whole: a plain one's usage is read from its tail."""
        if self.stream and self.chunked:
            return
        tail = self._tail
        at = tail.rfind(b'"usage"')  # the last one: a prompt may mention "usage" too
        got = read_usage(tail, at) if at >= 0 else None
        if got is not None:
            self.prompt, self.completion = got
            self.seen = True


def with_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A stream's request asking the engine for usage; True when the client had not asked
    (its usage event is then stripped)."""
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, False
    opts = dict(options) if isinstance(options, dict) else {}
    opts["include_usage"] = True
    return {**body, "stream_options": opts}, True


_ASK = b'{"stream_options":{"include_usage":true},'


def usage_body(body: dict[str, Any], raw: bytes) -> bytes | None:
    """The bytes to send the engine for a metered stream, or None to send the client's
    (it asked for usage itself). Without stream_options the key is spliced in after the
    object's `{` (the body parsed as an object with at least `model` in it); with other
    stream_options it is written again."""
    asked, strip = with_usage(body)
    if not strip:
        return None
    if "stream_options" not in body:
        start = raw.find(b"{")
        return _ASK + raw[start + 1:]
    return json.dumps(asked).encode()


class UsageMeter:
    def __init__(self) -> None:
        # Per group: [requests, prompt, completion, latency], made rows when sealed (a
        # list added to in place: this runs once per request).
        self.rows: dict[tuple[str, str, int, int], list[float]] = {}
        self.sealed: tuple[str, tuple[UsageRow, ...]] | None = None  # sent, not acked

    def add(self, key: str, model: str, status: int, prompt: int, completion: int,
            latency: float, now: float) -> None:
        g = (key, model, int(now // HOUR * HOUR), status)
        have = self.rows.get(g)
        if have is None:
            self.rows[g] = [1, prompt, completion, latency]
        else:
            have[0] += 1
            have[1] += prompt
            have[2] += completion
            have[3] += latency

    def batch(self, new_id: str) -> tuple[str, tuple[UsageRow, ...]] | None:
        """The batch to send now: the unacknowledged one again, else what was counted
        since (sealed with `new_id`), else None."""
        if self.sealed is not None:
            return self.sealed
        if not self.rows:
            return None
        groups = sorted(self.rows)[:MAX_ROWS]
        rows = []
        for g in groups:
            n, p, c, lat = self.rows.pop(g)
            rows.append(UsageRow(g[0], g[1], g[2], g[3], int(n), int(p), int(c), lat))
        self.sealed = (new_id, tuple(rows))
        return self.sealed

    def acked(self, batch_id: str) -> None:
        if self.sealed is not None and self.sealed[0] == batch_id:
            self.sealed = None

    @property
    def unsent(self) -> int:
        """Requests counted and not yet acknowledged."""
        n = int(sum(r[0] for r in self.rows.values()))
        return n + (sum(r.requests for r in self.sealed[1]) if self.sealed else 0)
