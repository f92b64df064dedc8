"""A pre-flight that failed on its rendezvous port (issue 30 item 4), server side: the
port's fault, not the nodes'. The gang is placed again at once on another port (the head
reported the port as in conflict: placement never gives it on that node again), no
restart counted, and no node avoided — before, both nodes were avoided for 600 s, and a
replica with nowhere else to go waited that long."""

from __future__ import annotations

from test_reconcile_preflight import Kept, preflight_tail

from llmgw.model.deployment import ReplicaState
from llmgw.model.engine import EngineReport, EngineState
from llmgw.model.preflight import EXIT_CODE, port_in_use
from llmgw.server.reconcile.rules import NodeDelta

S = ReplicaState
TORCH = ("DistNetworkError: The server socket has failed to listen on any local network address. "
         "port: {p}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


def in_use(port: int) -> str:
    return f"rendezvous port {port} is in use ({TORCH.format(p=port)})"


def test_the_servers_reading_of_the_launchers_reason() -> None:
    assert port_in_use(in_use(29611)) == 29611
    assert port_in_use("bus bandwidth 0.4 GB/s is below 10 GB/s") == 0
    assert port_in_use("timed out after 60s; rendezvous port 5 is in use") == 0  # the start only


def _report(k: Kept, node: str, **kw: object) -> None:
    r = k.r
    rep = EngineReport(replica_id=r.id, generation=r.generation, **kw)  # type: ignore[arg-type]
    k.state.node(NodeDelta(node, k.nodes[node], (rep,)))


def test_a_port_fault_places_the_gang_again_on_the_same_nodes_avoiding_none() -> None:
    k = Kept("a", "b")  # two nodes only: avoiding them would leave it nowhere to go
    head, member = k.r.node_ids
    port = k.r.members[0].rendezvous_port
    gen = k.r.generation
    # The head could not bind; the member's probe timed out waiting for it (both in one
    # pass: the head's is the cause, whichever comes first in member order).
    _report(k, member, state=EngineState.EXITED, exit_code=EXIT_CODE,
            log_tail=preflight_tail("timed out after 60s (a peer that never came, or a collective that hangs)"))
    _report(k, head, state=EngineState.EXITED, exit_code=EXIT_CODE, conflict_port=port,
            log_tail=preflight_tail(in_use(port)))
    k.step()
    r = k.r
    assert r.placed and r.generation > gen and sorted(r.node_ids) == ["a", "b"], r
    assert r.state == S.STARTING and r.restarts == 0
    assert not k.state.avoid
    texts = [e.text for e in k.res.events]
    assert any(t.startswith(f"port {port} on {head} is taken (rendezvous port {port} is in use (")
               and t.endswith("): placing again on another port, avoiding no node") for t in texts), texts


def test_a_port_fault_without_the_port_reported_still_avoids_no_node() -> None:
    """An agent that did not say which port (an older one): placed again, avoiding none,
    counted, so that a port taken again and again still ends in a crash loop."""
    k = Kept("a", "b")
    gen = k.r.generation
    k.report(EngineState.EXITED, exit_code=EXIT_CODE, log_tail=preflight_tail(in_use(29611)))
    r = k.r
    assert r.placed and r.generation > gen and r.restarts == 1 and not k.state.avoid
    assert any(e.text.startswith("pre-flight: rendezvous port 29611 is in use (DistNetworkError")
               and e.text.endswith("; placing again, avoiding no node")  # the reason at most 200
               for e in k.res.events), [e.text for e in k.res.events]
