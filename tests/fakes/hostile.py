"""Hostile peers for black-box tests of a real `llmgw server`: a raw CURVE DEALER that
sends whatever bytes it is given, and hypothesis strategies for the frames to send.

Nothing here knows the server's internals. Valid samples are built with the codec from
the message classes; request messages are found by walking `codec.KINDS` at run time, so
these strategies keep working while the request messages change shape.
"""

from __future__ import annotations

import os
import time
import typing
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import msgpack
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from llmgw import PROTOCOL_VERSION
from llmgw.errors import ProtocolError
from llmgw.model.engine import EngineKind, EngineReport, EngineSpec, EngineState
from llmgw.model.inventory import Gpu, GpuSource, Inventory, NodeInfo
from llmgw.transport import codec
from llmgw.transport.keys import load_pair, load_public
from llmgw.transport.messages import (
    ClearGpu,
    DesiredSet,
    EngineChanged,
    Heartbeat,
    HeartbeatAck,
    Hello,
    HelloFirst,
    InventoryChanged,
    LogsReply,
    LogsRequest,
    Rediscover,
    Refused,
    Welcome,
)

AGENT_KINDS = ("hello", "heartbeat", "inventory_changed", "engine_changed", "logs_reply")
SERVER_ONLY_KINDS = ("welcome", "desired_set", "heartbeat_ack", "refused", "hello_first",
                     "rediscover", "logs_request", "reply", "not_leader", "clear_gpu", "router_keys")

# ---- the raw peer ----


class RawPeer:
    """A blocking CURVE DEALER with its own zmq context. `send` takes raw frames; nothing
    is validated on the way out. Close it (or use it as a context manager)."""

    def __init__(self, address: str, secret_file: str | Path, server_key_file: str | Path,
                 *, send_timeout_ms: int = 5000) -> None:
        pair = load_pair(str(secret_file))
        self.ctx: zmq.Context[Any] = zmq.Context()
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.setsockopt(zmq.RECONNECT_IVL, 50)
        s.curve_secretkey = pair.secret_key
        s.curve_publickey = pair.public_key
        s.curve_serverkey = load_public(str(server_key_file))
        s.connect(address)
        self.sock = s
        self.sent = 0

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def send(self, *frames: bytes) -> None:
        """One message of one or more frames. Raises zmq.Again when the server takes
        nothing for `send_timeout_ms`."""
        self.sock.send_multipart(list(frames))
        self.sent += 1

    def send_msg(self, msg: Any) -> None:
        self.send(codec.encode(msg))

    def recv_raw(self, timeout: float) -> list[bytes] | None:
        if self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            return self.sock.recv_multipart()
        return None

    def drain(self) -> int:
        """Throw away whatever the server has sent so far; how many messages."""
        n = 0
        while self.sock.poll(0, zmq.POLLIN):
            self.sock.recv_multipart()
            n += 1
        return n

    def recv_until(self, pred: Callable[[Any], bool], timeout: float) -> Any | None:
        """The first decodable message within `timeout` for which `pred` holds, or None."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            parts = self.recv_raw(left)
            if parts is None or len(parts) != 1:
                continue
            try:
                msg = codec.decode(parts[0])
            except ProtocolError:
                continue
            if pred(msg):
                return msg
        return None

    def hello(self, node_id: str, timeout: float = 5.0, **kw: Any) -> Any | None:
        """Send a valid Hello for `node_id`; the Welcome or Refused it gets (None: silence)."""
        self.drain()
        self.send_msg(hello_msg(node_id, **kw))
        return self.recv_until(lambda m: isinstance(m, Welcome | Refused), timeout)

    def welcomed(self, node_id: str, timeout: float = 20.0) -> bool:
        """Send a valid Hello for `node_id` and wait for its Welcome, past the answers
        still on their way to frames sent before (a long fuzz leaves a backlog of them)."""
        self.drain()
        self.send_msg(hello_msg(node_id))
        return self.recv_until(lambda m: isinstance(m, Welcome), timeout) is not None

    def request(self, op: str, params: dict[str, Any] | None = None, timeout: float = 5.0) -> str:
        """Send `op` as the current request message for it: "ok", "refused" (Refused, or
        a reply that says no) or "silent" (nothing within `timeout`)."""
        self.drain()
        rid, frame = request_frame(op, params or {})
        self.send(frame)
        msg = self.recv_until(lambda m: isinstance(m, Refused) or getattr(m, "request_id", None) == rid,
                              timeout)
        return outcome(msg)


def outcome(msg: Any) -> str:
    if msg is None:
        return "silent"
    if isinstance(msg, Refused):
        return "refused"
    if hasattr(msg, "ok"):
        return "ok" if msg.ok else "refused"
    return "refused" if getattr(msg, "error", "") else "ok"


# ---- valid messages ----


def hello_msg(node_id: str, mgmt_addr: str = "127.0.0.1", inventory: Inventory | None = None,
              engines: Iterable[EngineReport] = ()) -> Hello:
    return Hello(PROTOCOL_VERSION, NodeInfo(node_id, mgmt_addr), inventory or Inventory(),
                 tuple(engines))


def engine_report(replica_id: str, log_tail_bytes: int = 0, state: EngineState = EngineState.EXITED,
                  generation: int = 1) -> EngineReport:
    tail: tuple[str, ...] = ()
    if log_tail_bytes:
        line = "E" * 1023
        tail = tuple(f"{line}" for _ in range(max(1, log_tail_bytes // 1024)))
    return EngineReport(replica_id, generation, state, endpoint="http://127.0.0.1:1", pid=4242,
                        exit_code=1, reason="crashed", log_tail=tail)


def _request_candidates(op: str, params: dict[str, Any], rid: str) -> Iterable[dict[str, Any]]:
    head = {"protocol": PROTOCOL_VERSION, "request_id": rid}
    # One generic Request: {"op": "status", "params": {...}}, or a typed op inside it.
    yield {"kind": "request", **head, "op": op, "params": params}
    yield {"kind": "request", **head, "op": {"op": op, **params}}
    yield {"kind": "request", **head, "op": {"kind": op, **params}}
    # One message kind per op.
    names = [k for k in codec.KINDS if k not in AGENT_KINDS and k not in SERVER_ONLY_KINDS]
    for kind in sorted((k for k in names if op in k.split("_")), key=len):
        yield {"kind": kind, **head, **params}


def request_frame(op: str, params: dict[str, Any]) -> tuple[str, bytes]:
    """(request id, encoded request for `op`), in whichever shape the codec accepts now:
    the first candidate wire form that `codec.decode` takes. Nothing here hard-codes the
    request classes, which are being reshaped."""
    rid = uuid.uuid4().hex
    for raw in _request_candidates(op, params, rid):
        frame = msgpack.packb(raw, use_bin_type=True)
        try:
            codec.decode(frame)
        except ProtocolError:
            continue
        return rid, frame
    raise AssertionError(f"no request shape for op {op!r} that the codec accepts ({sorted(codec.KINDS)})")


# Requests that ctl and the router send, with parameters a real client would use.
SAMPLE_OPS: list[tuple[str, dict[str, Any]]] = [
    ("status", {}), ("endpoints", {}), ("get", {"what": "replicas"}), ("get", {"what": "nodes"}),
    ("describe", {"name": "chat"}), ("delete", {"name": "nope"}), ("scale", {"name": "nope", "replicas": 2}),
    ("cordon", {"node": "gpu-a-01", "cordoned": False, "draining": False}),
    ("logs", {"replica": "r-1", "lines": 10}), ("rediscover", {"nodes": ["nope"]}),
    # The router's ops and the read-only or harmless key ops (issue 24).
    ("loadreport", {"models": {}, "interval": 5.0}), ("keytable", {"since": ""}),
    ("lease", {"key": "k1", "kind": "rpm", "want": 3, "unused": []}),
    ("lease", {"key": "k1", "kind": "concurrency", "want": 1, "unused": [], "term": "-",
               "held": [{"key": "k1", "kind": "concurrency", "term": "ab", "grant_id": 2,
                         "units": 1, "left": 9.5}]}),
    ("usagereport", {"batch_id": "batch-0001", "rows": [
        {"api_key": "k1", "model": "org/a", "hour": 490000, "status": 200, "requests": 1,
         "prompt_tokens": 5, "completion_tokens": 7, "latency_sum": 0.25}]}),
    ("usage", {}), ("apikeylist", {}), ("apikeyrevoke", {"name": "nope"}),
    ("gpuclear", {"node": "nope", "gpu": "0"}),  # issue 30: no such node, refused
]


def request_samples() -> list[bytes]:
    """Encoded sample requests, one for every op of SAMPLE_OPS (an op the codec no longer
    takes fails here, rather than dropping out of the fuzzing unseen)."""
    return [request_frame(op, params)[1] for op, params in SAMPLE_OPS]


# ---- strategies ----

short_text = st.text(max_size=24)
ids = st.from_regex(r"\A[a-z][a-z0-9-]{0,20}\Z")

edge_ints = st.sampled_from([0, -1, 1, 2**31, -(2**31) - 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1,
                             -(2**63)])
# msgpack cannot carry ints beyond these; the nearest a peer can send is an ext or a float.
odd_scalars = st.sampled_from([
    float("nan"), float("inf"), -float("inf"), -0.0, 1e308,
    msgpack.ExtType(1, b"\x00" * 8), msgpack.ExtType(0, b"\xff" * 12), msgpack.ExtType(127, b""),
])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), edge_ints,
                    st.floats(), odd_scalars, short_text, st.binary(max_size=32))

wild_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(short_text, children, max_size=4)),
    max_leaves=12,
)

# Things to put where `kind` goes that are not a plain string kind.
hostile_kinds = st.one_of(
    st.sampled_from([[], {}, 1, 0, -1, None, True, 1.5, b"hello", [1], {"a": 1}, ["hello"],
                     {"kind": "hello"}, 2**64 - 1]),
    wild_values,
)
near_kinds = st.one_of(
    short_text,
    st.sampled_from(list(codec.KINDS)).flatmap(
        lambda k: st.sampled_from([k.upper(), k + " ", " " + k, k + "\x00", k[:-1], "x" * 3000])),
)


def _safe_encode(msg: Any) -> bytes:
    try:
        return codec.encode(msg)
    except Exception:  # the message classes accept what msgpack cannot carry
        return msgpack.packb({"kind": codec.kind_of(msg)}, use_bin_type=True)


def _strategy_for(cls: type) -> st.SearchStrategy[Any] | None:
    """st.builds(cls), with wild values where the type says Any; None if hypothesis cannot."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        return None
    overrides: dict[str, st.SearchStrategy[Any]] = {}
    for name, tp in hints.items():
        if tp is Any:
            overrides[name] = wild_values
        elif "Any" in repr(tp):
            overrides[name] = st.dictionaries(short_text, wild_values, max_size=4) if \
                typing.get_origin(tp) is dict else wild_values
    try:
        strat = st.builds(cls, **overrides)
        strat.validate()
    except Exception:
        return None
    return strat


def _draws(strat: st.SearchStrategy[Any]) -> bool:
    """Whether hypothesis can draw from `strat` at all (types it cannot resolve fail late)."""
    @settings(max_examples=3, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strat)
    def probe(_: Any) -> None:
        pass

    try:
        probe()
    except Exception:
        return False
    return True


def _kind_strategies(kinds: Iterable[str]) -> list[st.SearchStrategy[bytes]]:
    """st.builds for each kind that hypothesis can build; those it cannot are skipped."""
    out = []
    for kind in kinds:
        s = _strategy_for(codec.KINDS[kind])
        if s is not None and _draws(s):
            out.append(s.map(_safe_encode))
    return out


def request_kinds() -> list[str]:
    """The ctl/router request kinds the codec knows today (whatever their shape)."""
    return [k for k in codec.KINDS if k not in AGENT_KINDS and k not in SERVER_ONLY_KINDS]


gpus = st.builds(Gpu, index=st.integers(0, 7), uuid=ids.map(lambda s: "GPU-" + s), name=short_text,
                 memory_total=st.integers(0, 2**20), memory_free=st.integers(0, 2**20),
                 pci_bus_id=short_text)
inventories = st.builds(Inventory, gpus=st.lists(gpus, max_size=3).map(tuple),
                        gpu_source=st.sampled_from(list(GpuSource)),
                        warnings=st.lists(short_text, max_size=3).map(tuple))
reports = st.builds(EngineReport, replica_id=ids, generation=st.integers(0, 2**63 - 1),
                    state=st.sampled_from(list(EngineState)), reason=short_text,
                    log_tail=st.lists(st.text(max_size=200), max_size=5).map(tuple),
                    # An engine's own key (issue 30): what a header may carry, or none.
                    api_key=st.text(alphabet="abcXYZ019-_.~+/=", max_size=128))
specs = st.builds(EngineSpec, replica_id=ids, generation=st.integers(0, 100), deployment=ids, model=ids,
                  served_name=ids, engine=st.sampled_from(list(EngineKind)),
                  gpus=st.lists(short_text, max_size=2).map(tuple), port=st.integers(1, 65535))


def valid_agent_messages(node_ids: list[str]) -> st.SearchStrategy[Any]:
    """Well-formed agent messages; Hellos name one of `node_ids`."""
    hellos = st.builds(Hello, protocol=st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1, 0, -1]),
                       node=st.builds(NodeInfo, node_id=st.sampled_from(node_ids), mgmt_addr=short_text),
                       inventory=inventories, engines=st.lists(reports, max_size=3).map(tuple))
    return st.one_of(
        hellos,
        st.builds(Heartbeat, seq=st.integers(-(2**63), 2**64 - 1)),
        st.builds(InventoryChanged, inventory=inventories),
        st.builds(EngineChanged, report=reports),
        st.builds(LogsReply, request_id=short_text, replica_id=ids,
                  lines=st.lists(st.text(max_size=100), max_size=5).map(tuple), error=short_text),
    )


server_only_messages: st.SearchStrategy[Any] = st.one_of(
    st.builds(Welcome, protocol=st.integers(0, 9), node_id=ids, heartbeat_interval=st.floats(0, 10)),
    st.builds(Refused, reason=short_text),
    st.builds(HelloFirst, reason=short_text),
    st.builds(HeartbeatAck, seq=st.integers(0, 2**63)),
    st.builds(DesiredSet, generation=st.integers(0, 2**63), engines=st.lists(specs, max_size=2).map(tuple)),
    st.just(Rediscover()),
    st.builds(ClearGpu, gpus=st.lists(short_text, max_size=3).map(tuple)),
    st.builds(LogsRequest, request_id=short_text, replica_id=ids, lines=st.integers(-5, 10**9)),
)


def valid_frames(node_ids: list[str]) -> st.SearchStrategy[bytes]:
    """Encoded well-formed messages of every kind: agent, server-only and the request
    kinds found in the codec today."""
    samples = request_samples()
    return st.one_of(
        valid_agent_messages(node_ids).map(_safe_encode),
        *([st.sampled_from(samples)] if samples else []),
        server_only_messages.map(_safe_encode),
        *_kind_strategies(request_kinds()),
        *_kind_strategies([k for k in SERVER_ONLY_KINDS if k in codec.KINDS]),
    )


def deep_list(depth: int) -> bytes:
    """A list nested `depth` deep, by hand: msgpack.packb refuses nesting this deep."""
    return b"\x91" * depth + b"\xc0"


def deep_in_kind(depth: int) -> bytes:
    return b"\x81\xa4kind" + deep_list(depth)


def deep_in_field(frame: bytes, depth: int) -> bytes:
    """`frame` (a map) with one more key whose value is nested `depth` deep."""
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        raw = None
    if not isinstance(raw, dict) or len(raw) >= 15:
        return deep_in_kind(depth)
    body = msgpack.packb(raw, use_bin_type=True)[1:]  # drop the fixmap header
    return bytes([0x80 | (len(raw) + 1)]) + body + b"\xa5extra" + deep_list(depth)


@st.composite
def byte_mutations(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "dup"]))
        if not data:
            data = bytearray(draw(st.binary(min_size=1, max_size=8)))
            continue
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[i:]
        else:
            data[i:i] = data[i:i + draw(st.integers(1, 16))]
    return bytes(data)


@st.composite
def structural_mutations(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    """Decode a valid frame's map, then drop a key, add an unknown one, put a value of
    another type somewhere, or a hostile kind."""
    raw = msgpack.unpackb(draw(base), raw=False, strict_map_key=False)
    if not isinstance(raw, dict):
        raw = {"kind": raw}

    def mutate(value: Any, depth: int) -> Any:
        if isinstance(value, dict) and value and depth < 4:
            key = draw(st.sampled_from(sorted(value, key=repr)))
            op = draw(st.sampled_from(["drop", "add", "replace", "recurse", "recurse"]))
            value = dict(value)
            if op == "drop":
                del value[key]
            elif op == "add":
                value[draw(st.one_of(short_text, st.sampled_from(["kind", "extra", "__class__"])))] = \
                    draw(wild_values)
            elif op == "replace":
                value[key] = draw(wild_values)
            else:
                value[key] = mutate(value[key], depth + 1)
            return value
        if isinstance(value, list) and value and depth < 4:
            value = list(value)
            i = draw(st.integers(0, len(value) - 1))
            value[i] = mutate(value[i], depth + 1)
            return value
        return draw(wild_values)

    mutated = mutate(raw, 0)
    if draw(st.integers(0, 9)) == 0 and isinstance(mutated, dict):
        mutated["kind"] = draw(st.one_of(hostile_kinds, near_kinds))
    try:
        return msgpack.packb(mutated, use_bin_type=True)  # type: ignore[no-any-return]
    except Exception:  # wild values msgpack will not carry
        return msgpack.packb({"kind": draw(hostile_kinds)}, use_bin_type=True)  # type: ignore[no-any-return]


# Hand-made msgpack that packb never writes: timestamps, bad ext lengths, huge declared
# sizes, reserved bytes, a map with a map or list as key.
RAW_ODDITIES = [
    b"\x81\xa4kind\xd6\xff\x00\x00\x00\x01",  # kind: timestamp ext
    b"\x81\xa4kind\xc7\x0c\xff" + b"\xff" * 12,  # kind: a bad 96-bit timestamp
    b"\x81\xa4kind\xdb\xff\xff\xff\xff",  # kind: str32 that claims 4 GiB
    b"\xdf\xff\xff\xff\xff",  # map32 that claims 4 billion pairs
    b"\xdd\xff\xff\xff\xff",  # array32 that claims 4 billion items
    b"\x81\x80\xa1x", b"\x81\x90\xa1x",  # map keyed by a map, by a list
    b"\x81\xc0\xa1x", b"\x81\x01\xa1x",  # map keyed by nil, by an int
    b"\xc1", b"\x81\xa4kind\xc1",
    b"\x81\xa4kind\xa5hello" + b"\x00" * 3,  # trailing bytes
    b"\x82\xa4kind\xa5hello\xa4kind\xa5hello",  # duplicate key
]


def _packb(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]
    except Exception:
        return b"\xc1"  # the one byte msgpack never uses


@attrs.frozen
class Send:
    """One thing an attacker does: send `frames` as one message, `repeat` times."""

    frames: tuple[bytes, ...]
    repeat: int = 1
    category: str = ""


def hostile_sends(node_ids: list[str], max_message_size: int, forged_tail: int = 4096
                  ) -> st.SearchStrategy[Send]:
    """Everything an authorized but hostile peer might send, by category, weighted so
    that the cheap kinds dominate and connection-cutting over-size frames are rare."""
    valid = valid_frames(node_ids)
    single = {
        "random_bytes": st.one_of(st.binary(max_size=256), st.sampled_from(RAW_ODDITIES)),
        "truncated": valid.flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n])),
        "byte_mutation": byte_mutations(valid),
        "structural": structural_mutations(valid),
        "hostile_kind": st.builds(lambda k, extra: _packb({"kind": k, **extra}), hostile_kinds,
                                  st.dictionaries(short_text, wild_values, max_size=3)),
        "unknown_kind": st.builds(lambda k: _packb({"kind": k, "x": 1}), near_kinds),
        "not_a_map": wild_values.map(_packb),
        "valid": valid,
        "server_only": server_only_messages.map(_safe_encode),
        "deep": st.sampled_from([10, 100, 511, 1000, 1025, 10_000]).flatmap(
            lambda d: st.sampled_from([deep_list(d), deep_in_kind(d)])),
        "deep_field": st.builds(deep_in_field, valid, st.sampled_from([50, 600, 1000, 10_000])),
        "forged_report": st.builds(
            lambda rid, tail: codec.encode(EngineChanged(engine_report(rid, tail))),
            ids.map(lambda s: "forged-" + s), st.sampled_from([0, 1024, forged_tail])),
        "hello_other": st.builds(lambda n: codec.encode(hello_msg(n)),
                                 st.one_of(st.sampled_from(node_ids), ids)),
        "big_hello": st.builds(
            lambda n: _safe_encode(hello_msg(n, inventory=Inventory(warnings=tuple("w" * 50 for _ in range(n))))),
            st.sampled_from([100, 1000])),
    }
    weights = {k: 10 for k in single}
    weights.update(random_bytes=15, byte_mutation=20, structural=20, valid=12, deep=3, deep_field=3,
                   big_hello=2)
    cats = [st.tuples(st.just(k), s.map(lambda b: (b,))) for k, s in single.items()]
    cat_weights = [weights[k] for k in single]
    multipart = st.tuples(st.just("multipart"),
                          st.lists(st.one_of(st.binary(max_size=64), valid), min_size=2, max_size=5).map(tuple))
    flood = st.tuples(st.just("flood"), st.one_of(single["hello_other"], single["valid"], single["forged_report"],
                                                  single["hostile_kind"]).map(lambda b: (b,)))
    oversize = st.tuples(st.just("oversize"), st.integers(1, 4096).map(
        lambda extra: (os.urandom(max_message_size + extra),)))
    cats += [multipart, flood, oversize]
    cat_weights += [6, 3, 1]
    total = sum(cat_weights)

    @st.composite
    def pick(draw: st.DrawFn) -> Send:
        n = draw(st.integers(0, total - 1))
        for strat, w in zip(cats, cat_weights, strict=True):
            if n < w:
                cat, frames = draw(strat)
                repeat = draw(st.integers(10, 60)) if cat == "flood" else 1
                return Send(frames, repeat, cat)
            n -= w
        raise AssertionError("unreachable")

    return pick()


# ---- server process figures ----


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def longest_line(path: Path, start: int = 0) -> tuple[int, str]:
    """Length of the longest line written to `path` from byte `start` on, and its start."""
    with open(path, "rb") as f:
        f.seek(start)
        best, head = 0, b""
        for line in f:
            if len(line) > best:
                best, head = len(line), line[:200]
    return best, head.decode(errors="replace")
