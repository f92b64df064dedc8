from __future__ import annotations

import zmq
from zmq.utils import z85

from llmgw.transport.keys import KeyInfo
from llmgw.transport.zap import zap_reply

PUB, _ = zmq.curve_keypair()
KNOWN = {PUB: KeyInfo("gpu-a-01", "node", PUB)}


def request(mechanism: bytes = b"CURVE", key: bytes = PUB) -> list[bytes]:
    return [b"1.0", b"7", b"llmgw", b"127.0.0.1", b"", mechanism, z85.decode(key)]


def test_known_key_gets_its_public_key_as_user_id() -> None:
    reply = zap_reply(request(), KNOWN.get)
    assert reply[:4] == [b"1.0", b"7", b"200", b"OK"]
    assert reply[4] == PUB  # the server looks the key up per message, never trusts a name


def test_unknown_key_refused() -> None:
    other, _ = zmq.curve_keypair()
    assert zap_reply(request(key=other), KNOWN.get)[2] == b"400"


def test_plain_and_null_mechanisms_refused() -> None:
    assert zap_reply(request(mechanism=b"NULL")[:6], KNOWN.get)[2] == b"400"
    assert zap_reply(request(mechanism=b"PLAIN"), KNOWN.get)[2] == b"400"


def test_malformed_requests_are_errors() -> None:
    assert zap_reply([b"1.0"], KNOWN.get)[2] == b"500"
    assert zap_reply([b"2.0", *request()[1:]], KNOWN.get)[2] == b"500"
