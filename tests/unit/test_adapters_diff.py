"""The adapter diff (pure): wanted against what the engine lists, and what it has after."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.lora.adapters import Load, Unload, adapter_actions, after, answer_error, loaded_adapters
from llmgw.agent.lora.sync import parse_answer
from llmgw.model.engine import Adapter

SQL, CHAT = Adapter("sql", "/a/sql"), Adapter("chat", "/a/chat")


def test_loads_what_is_missing_unloads_what_is_not_wanted_unloads_first() -> None:
    assert adapter_actions((SQL, CHAT), {}) == (Load("sql", "/a/sql"), Load("chat", "/a/chat"))
    assert adapter_actions((SQL,), {"sql": "/a/sql", "old": "/a/old"}) == (Unload("old"),)
    assert adapter_actions((SQL, CHAT), {"sql": "/a/sql", "chat": "/a/chat"}) == ()
    # A name loaded from another path: unloaded, then loaded from the wanted one.
    assert adapter_actions((SQL,), {"sql": "/a/sql-v1"}) == (Unload("sql"), Load("sql", "/a/sql"))


@given(st.dictionaries(st.sampled_from("abcde"), st.sampled_from(["/p", "/q"])),
       st.dictionaries(st.sampled_from("abcde"), st.sampled_from(["/p", "/q"])))
def test_carrying_out_the_actions_gives_the_wanted_set_and_nothing_more(
        loaded: dict[str, str], want: dict[str, str]) -> None:
    wanted = tuple(Adapter(n, p) for n, p in sorted(want.items()))
    actions = adapter_actions(wanted, loaded)
    result = after(loaded, dict.fromkeys(actions, ""), wanted)
    assert set(result.loaded) == set(want) and result.errors == ()
    assert adapter_actions(wanted, {a.name: a.path for a in wanted}) == ()  # level-triggered


def test_a_failed_load_is_reported_and_not_counted_loaded() -> None:
    err = "Loading lora chat failed: No adapter found for /a/chat (HTTP 404)"
    result = after({}, {Load("sql", "/a/sql"): "", Load("chat", "/a/chat"): err}, (SQL, CHAT))
    assert result.loaded == ("sql",) and result.errors == (f"chat: {err}",)
    # An unload the engine cannot find is gone all the same; another failure keeps it.
    gone = after({"x": "/x"}, {Unload("x"): "The lora adapter 'x' cannot be found. (HTTP 404)"}, ())
    assert gone.loaded == () and gone.errors == ()
    kept = after({"x": "/x"}, {Unload("x"): "HTTP 500"}, ())
    assert kept.loaded == ("x",) and kept.errors == ("x: unload failed: HTTP 500",)


def test_vllms_model_list_gives_the_adapters_with_their_paths() -> None:
    body = json.dumps({"object": "list", "data": [
        {"id": "llama", "root": "/models/llama", "parent": None},
        {"id": "sql", "root": "/a/sql", "parent": "llama"},
    ]}).encode()
    assert loaded_adapters(body, "llama") == {"sql": "/a/sql"}
    for bad in (b"<html>", b"[]", b'{"data": 3}'):
        try:
            loaded_adapters(bad, "llama")
        except ValueError:
            continue
        raise AssertionError(bad)


def test_the_engines_error_message_is_kept() -> None:
    body = json.dumps({"error": {"message": "No adapter found for /x", "type": "NotFoundError",
                                 "code": 404}}).encode()
    assert answer_error(404, body) == "No adapter found for /x (HTTP 404)"
    assert answer_error(200, b"Success") == ""
    assert answer_error(502, b"bad gateway") == "HTTP 502: bad gateway"
    assert answer_error(500, b"") == "HTTP 500"


def test_answers_read_whole_plain_and_chunked() -> None:
    plain = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA"
    assert parse_answer(plain, "x") == (200, b"ok")
    chunked = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    assert parse_answer(chunked, "x") == (404, b"abcde")
