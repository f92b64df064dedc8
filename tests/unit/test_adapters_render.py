"""describe replica: the adapters each head engine has loaded, and why one is not."""

from __future__ import annotations

from llmgw.ctl.render import _adapters


def test_loaded_adapters_and_errors_per_node() -> None:
    lines = _adapters({"n1": {"loaded": ["sql", "chat"], "errors": ["lost: No adapter found for /x"]}})
    assert lines == ["Adapters:   sql, chat (on n1)", "  not loaded: lost: No adapter found for /x"]
    assert _adapters({"n1": {"loaded": [], "errors": []}}) == ["Adapters:   none (on n1)"]
    assert _adapters(None) == [] and _adapters("junk") == []  # a server that does not send it
