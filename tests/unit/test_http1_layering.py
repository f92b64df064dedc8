"""HTTP/1.1 lives below the router: llmgw.http1 imports nothing of the router, and the
agent and the server (which serve /metrics through it) load no router module (checked on
the source with ast, transitively, package __init__.py files included)."""

from __future__ import annotations

import pytest
from tests.unit.test_pure_cores import _imports, _path


def _reach(module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen or not _path(m).exists():
            continue
        seen.add(m)
        parts = m.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(n for n in _imports(m) if n.startswith("llmgw."))
    return seen


@pytest.mark.parametrize("module", ["llmgw.http1.serve", "llmgw.http1.client", "llmgw.agent.run",
                                    "llmgw.server.peers.service", "llmgw.dev"])
def test_no_router_module_is_loaded(module: str) -> None:
    reached = _reach(module)
    assert module in reached
    router = sorted(m for m in reached if m.startswith("llmgw.router") and m != "llmgw.router")
    if module == "llmgw.dev":  # dev runs the router: it must reach it, so the check can see
        assert "llmgw.router.service" in router
    else:
        assert router == []
