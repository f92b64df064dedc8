"""msgpack through cattrs: a tagged union of the message classes.

An unknown `kind` is rejected, never defaulted. Everything that can go wrong while
decoding bytes from a peer becomes a ProtocolError with a short reason.
"""

from __future__ import annotations

import re
import typing

import cattrs
import msgpack
from cattrs.preconf.msgpack import make_converter
from cattrs.strategies import configure_tagged_union

from llmgw.errors import ProtocolError
from llmgw.transport import messages
from llmgw.transport.messages import Message

_MEMBERS: tuple[type, ...] = typing.get_args(Message)


def _kind(cls: type) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


KINDS: dict[str, type] = {_kind(c): c for c in _MEMBERS}


def _make() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True)
    configure_tagged_union(Message, conv, tag_generator=_kind, tag_name="kind")
    return conv


converter = _make()


def encode(msg: Message) -> bytes:
    data = converter.unstructure(msg, Message)
    return msgpack.packb(data, use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"expected a map, got {type(raw).__name__}")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    try:
        return typing.cast(Message, converter.structure(raw, Message))  # type: ignore[arg-type]
    except Exception as exc:
        detail = "; ".join(cattrs.transform_error(exc)) if isinstance(
            exc, cattrs.BaseValidationError
        ) else str(exc)
        raise ProtocolError(f"bad {kind} message: {detail}") from None


def kind_of(msg: Message) -> str:
    return _kind(type(msg))


__all__ = ["KINDS", "converter", "decode", "encode", "kind_of", "messages"]
