"""msgpack through cattrs: a tagged union of the message classes.

An unknown `kind` is rejected, never defaulted. Everything that can go wrong while
decoding bytes from a peer becomes a ProtocolError with a short reason.
"""

from __future__ import annotations

import re
import typing

import cattrs
import msgpack
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.preconf.msgpack import make_converter
from cattrs.strategies import configure_tagged_union

from llmgw.config.deployment import parse_deployment
from llmgw.errors import ProtocolError
from llmgw.logbound import clip
from llmgw.model.deployment import Deployment
from llmgw.model.engine import EngineReport, EngineSpec, GangSpec
from llmgw.model.inventory import NodeInfo
from llmgw.transport import messages
from llmgw.transport.messages import Heartbeat, HeartbeatAck, Message
from llmgw.transport.requests import Op, op_name

_MEMBERS: tuple[type, ...] = typing.get_args(Message)


def _kind(cls: type) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


KINDS: dict[str, type] = {_kind(c): c for c in _MEMBERS}
_KIND_OF: dict[type, str] = {c: k for k, c in KINDS.items()}


def _exact(cls: type) -> typing.Callable[[object, type], typing.Any]:
    def hook(value: object, t: type) -> typing.Any:
        # bool is an int in Python; a bool where an int belongs is still wrong.
        if type(value) is not cls:
            raise ValueError(f"expected {cls.__name__}, got {type(value).__name__}")
        # The hook of str serves the str enums too: their constructor checks the value.
        return value if t is cls else t(value)

    return hook


def _make(*, detailed: bool) -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True, detailed_validation=detailed)
    # No coercion of what a peer sends: bool("false") is True, int(1.9) is 1.
    for cls in (bool, int, str):
        conv.register_structure_hook(cls, _exact(cls))
    # A deployment on the wire is what a deployment file holds, validated on arrival by
    # the one validator of deployments.
    conv.register_unstructure_hook(Deployment, Deployment.plain)
    conv.register_structure_hook(Deployment, lambda v, _: parse_deployment(v, "the request"))
    # A gang's common copy goes on the wire only when there is one: every other desired
    # set is byte for byte what it was before the key existed. A spec without it (from a
    # server before) reads as "" (none), as every defaulted field does.
    conv.register_unstructure_hook(GangSpec, make_dict_unstructure_fn(
        GangSpec, conv, weights_path=override(omit_if_default=True)))
    # KV-cache events likewise: a desired set without them is what it was before the key,
    # which an agent from before (forbid_extra_keys) still reads. Registered before
    # EngineReport's, whose `spec` is one.
    conv.register_unstructure_hook(EngineSpec, make_dict_unstructure_fn(
        EngineSpec, conv, kv_events=override(omit_if_default=True)))
    # An engine's key likewise (engine keys): a report without one is what it was before, so
    # that a server from before keys still reads an agent's reports of keyless engines.
    conv.register_unstructure_hook(EngineReport, make_dict_unstructure_fn(
        EngineReport, conv, api_key=override(omit_if_default=True)))
    # A node's KV relay likewise: a Hello from a node without one is what it was before,
    # which a server from before still reads (one with a relay needs a server that knows it).
    conv.register_unstructure_hook(NodeInfo, make_dict_unstructure_fn(
        NodeInfo, conv, kv_relay=override(omit_if_default=True)))
    configure_tagged_union(Op, conv, tag_generator=op_name, tag_name="op")
    configure_tagged_union(Message, conv, tag_generator=_kind, tag_name="kind")
    return conv


# Messages are structured by a converter that stops at the first problem: collecting every
# problem (cattrs' detailed validation) costs tens of microseconds per bad element, so a
# few KB of garbage would cost a quarter of a second of the server's CPU.
converter = _make(detailed=False)
# No list or map in any message has more items than this (a node's GPUs, model copies,
# log lines, labels); a longer one is refused by msgpack before any object is made.
MAX_ITEMS = 4096


# The heartbeat and its acknowledgement are most of what the server sends and receives:
# they take a path of their own, byte for byte what the converter makes of them
# (tests/unit/test_codec.py checks both ways).
_ACK_HEAD = b"\x82\xa3seq"
_ACK_TAIL = b"\xa4kind\xadheartbeat_ack"
_HEARTBEAT_KEYS = frozenset(("kind", "seq"))


def encode(msg: Message) -> bytes:
    if type(msg) is HeartbeatAck:
        return _ACK_HEAD + msgpack.packb(msg.seq) + _ACK_TAIL
    data = converter.unstructure(msg, Message)
    return msgpack.packb(data, use_bin_type=True)


def decode(data: bytes) -> Message:
    """Total: bytes from a peer -> a Message, or ProtocolError (and nothing else).

    The error's text is bounded: it names the kind and the first problems, never echoes
    a whole message back into a log line.
    """
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=MAX_ITEMS,
                              max_map_len=MAX_ITEMS)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not msgpack: {type(exc).__name__}: {clip(exc, 200)}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"expected a map, got {type(raw).__name__}")
    kind = raw.get("kind")
    if not isinstance(kind, str):
        # Only its type: repr() of a value nested a thousand deep would itself recurse.
        raise ProtocolError(f"unknown message kind: a {type(kind).__name__}, not a name")
    if kind == "heartbeat" and type(raw.get("seq")) is int and raw.keys() == _HEARTBEAT_KEYS:
        return Heartbeat(raw["seq"])
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {clip(repr(kind), 80)}")
    try:
        return typing.cast(Message, converter.structure(raw, Message))  # type: ignore[arg-type]
    except Exception as exc:  # whatever cattrs or an attrs validator raises on bad input
        rid = raw.get("request_id") if kind == "request" else None
        raise ProtocolError(f"bad {kind} message: {_problems(exc)}",
                            rid if isinstance(rid, str) and len(rid) <= 64 else "") from None


def _problems(exc: Exception) -> str:
    try:
        found = cattrs.transform_error(exc) if isinstance(exc, cattrs.BaseValidationError) else [str(exc)]
    except Exception:  # transform_error on an odd tree: the class name is enough
        found = [type(exc).__name__]
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return clip("; ".join(clip(f, 200) for f in found[:3]) + more, 800)


T = typing.TypeVar("T")


def structure_result(value: object, cls: type[T]) -> T:
    """Total: a Reply's result -> `cls`, or ProtocolError (a peer's answer is input too)."""
    try:
        return converter.structure(value, cls)
    except Exception as exc:  # whatever cattrs or a validator raises on bad input
        raise ProtocolError(f"bad {cls.__name__}: {_problems(exc)}") from None


def kind_of(msg: Message) -> str:
    return _KIND_OF.get(type(msg)) or _kind(type(msg))


__all__ = ["KINDS", "converter", "decode", "encode", "kind_of", "messages"]
