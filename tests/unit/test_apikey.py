"""API key records and secrets (model/apikey.py) and usage rows (model/usage.py), pure (issue 24)."""

from __future__ import annotations

import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.model.apikey import SHOWN, ApiKeyRecord, check_name, hash_secret, looks_like_secret, make_secret
from llmgw.model.usage import UsageRow, hour_of, merge


@given(st.binary(min_size=32, max_size=32))
def test_secrets_are_recognisable_and_carry_all_their_randomness(raw: bytes) -> None:
    s = make_secret(raw)
    assert looks_like_secret(s) and s.startswith("llmgw-") and len(s) == 49
    assert hash_secret(s) == hash_secret(s.encode()) and len(hash_secret(s)) == 64


def test_two_secrets_differ_and_bad_lengths_are_refused() -> None:
    a, b = make_secret(secrets.token_bytes(32)), make_secret(secrets.token_bytes(32))
    assert a != b and a[:SHOWN] != a
    for bad in (b"", bytes(31), bytes(33)):
        with pytest.raises(ValueError, match="32 random bytes"):
            make_secret(bad)
    assert not looks_like_secret("sk-" + a[6:]) and not looks_like_secret(a + "x")


def test_names_and_states() -> None:
    assert check_name("team-a.prod@eu") is None
    assert "expected a name" in (check_name("") or "") and check_name("a b") is not None
    k = ApiKeyRecord("a", "h", "p", models=("m",), expires=100.0)
    assert k.allows("m") and not k.allows("n") and ApiKeyRecord("b", "h", "p").allows("n")
    assert k.state(99.0) == "active" and k.live(99.0)
    assert k.state(100.0) == "expired" and not k.live(100.0)
    r = ApiKeyRecord("a", "h", "p", revoked=5.0)
    assert r.state(0.0) == "revoked" and not r.live(0.0)


def test_usage_rows_merge_by_group() -> None:
    assert hour_of(7199.9) == 3600 and hour_of(7200) == 7200
    rows = [UsageRow("a", "m", 0, 200, 1, 2, 3, 0.5), UsageRow("a", "m", 0, 200, 1, 2, 3, 0.5),
            UsageRow("a", "m", 0, 500, 1)]
    assert merge(rows) == [UsageRow("a", "m", 0, 200, 2, 4, 6, 1.0), UsageRow("a", "m", 0, 500, 1)]
