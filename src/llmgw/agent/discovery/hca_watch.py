"""Watch the labelled HCAs' ports: a port that leaves ACTIVE, or whose error counters
jump, is a problem on that HCA at once, and stays one until the port is ACTIVE and its
counters have been quiet for a while.

An mlx5 port that flaps takes every NCCL communicator over it down with it (llm-d#191);
nothing else in the agent reads the ports between discoveries (a minute apart). Here
they are read every `discovery.hca_interval` (2 s) from sysfs:
`<ib_root>/<hca>/ports/<n>/{state,phys_state,rate}` and `counters/<name>`.

`HcaHealth` is the pure core (samples and a time in, problems out); `read_samples` the
reader; `serve_hca_watch` the trio loop that calls `on_change` when a problem set moves.
The agent puts the problems into every inventory it reports (`HcaHealth.apply`); the
server stops counting an HCA with problems in its fabric and moves the replicas on it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping

import trio
from attrs import evolve, frozen

from llmgw.agent.discovery.infiniband import parse_rate, parse_state
from llmgw.config.agent import AgentConfig
from llmgw.model.inventory import FabricState, Hca, Inventory

log = logging.getLogger(__name__)

GONE = "not found in sysfs"

# Per counter, the rise between two readings that makes a problem. A link that went down
# and came back (link_downed), or retrained (link_error_recovery), has dropped packets and
# a communicator with them: any rise. Symbol and receive errors trickle on a healthy but
# marginal cable; a burst of them is a link about to go (the thresholds ibqueryerrors
# and UFM's defaults are of this order).
LIMITS: Mapping[str, int] = {
    "link_downed": 1,
    "link_error_recovery": 1,
    "local_link_integrity_errors": 1,
    "excessive_buffer_overrun_errors": 1,
    "symbol_error": 100,
    "port_rcv_errors": 100,
}


@frozen
class PortSample:
    """One port as read now. `counters` holds those of LIMITS that could be read."""

    hca: str
    port: int
    state: str  # "ACTIVE", "DOWN", ...; "" unreadable
    phys_state: str = ""
    rate_gbps: float = 0.0
    counters: Mapping[str, int] = {}


def parse_counter(text: str) -> int | None:
    """A sysfs counter file: "17\\n" -> 17; anything else -> None (unreadable)."""
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value >= 0 else None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(256)
    except (OSError, UnicodeDecodeError) as exc:
        log.debug("cannot read %s: %s", path, exc)
        return ""


def read_samples(ib_root: str, hcas: Iterable[str]) -> tuple[PortSample, ...]:
    """Every port of each HCA in `hcas`; an HCA without a readable ports folder gives one
    sample for port 0 with an empty state (it is gone, or sysfs is)."""
    out = []
    for hca in hcas:
        ports_dir = os.path.join(ib_root, hca, "ports")
        try:
            names = sorted((p for p in os.listdir(ports_dir) if p.isdigit()), key=int)
        except OSError as exc:
            log.debug("no ports for %s: %s", hca, exc)
            names = []
        if not names:
            out.append(PortSample(hca, 0, ""))
            continue
        for name in names:
            d = os.path.join(ports_dir, name)
            counters = {}
            for c in LIMITS:
                v = parse_counter(_read(os.path.join(d, "counters", c)))
                if v is not None:
                    counters[c] = v
            out.append(PortSample(
                hca, int(name), parse_state(_read(os.path.join(d, "state")).strip()),
                parse_state(_read(os.path.join(d, "phys_state")).strip()),
                parse_rate(_read(os.path.join(d, "rate")).strip()), counters,
            ))
    return tuple(out)


class HcaHealth:
    """HCA name -> its problems now, from successive samples. No I/O, no clock: `now` is
    given. `quiet`: seconds a port must be ACTIVE with no counter past its limit before
    its problems clear (a flapping link is back for a moment between drops)."""

    def __init__(self, quiet: float = 30.0, limits: Mapping[str, int] = LIMITS) -> None:
        self.quiet = quiet
        self.limits = dict(limits)
        self._last: dict[tuple[str, int], tuple[float, Mapping[str, int]]] = {}
        # (hca, port) -> (when it was last bad, the line saying why)
        self._bad: dict[tuple[str, int], tuple[float, str]] = {}
        self._problems: dict[str, tuple[str, ...]] = {}

    @property
    def problems(self) -> dict[str, tuple[str, ...]]:
        return dict(self._problems)

    def observe(self, samples: Iterable[PortSample], now: float) -> bool:
        """Take one round of samples; True when some HCA's problems changed."""
        lines: dict[str, list[str]] = {}
        for s in samples:
            key = (s.hca, s.port)
            why = self._why(s, now)
            if why:
                self._bad[key] = (now, why)
            mine = lines.setdefault(s.hca, [])
            if why:
                mine.append(why)
            elif key in self._bad:
                since, last = self._bad[key]
                if now - since < self.quiet:
                    # Fixed text: a ticking count would be a new inventory every round.
                    mine.append(f"{last.split('; ', 1)[0]}; counts again after "
                                f"{self.quiet:g}s ACTIVE and quiet")
                else:
                    del self._bad[key]
        new = {h: tuple(v) for h, v in lines.items() if v}
        changed = new != self._problems
        self._problems = new
        return changed

    def _why(self, s: PortSample, now: float) -> str:
        key = (s.hca, s.port)
        prev = self._last.get(key)
        self._last[key] = (now, s.counters)
        if not s.state:
            return f"port {s.port} unreadable" if s.port else GONE
        if s.state.upper() != "ACTIVE":
            return f"port {s.port} {s.state}" + (f" ({s.phys_state})" if s.phys_state else "")
        if prev is None:
            return ""
        then, old = prev
        jumps = []
        for c, limit in self.limits.items():
            if c in s.counters and c in old:
                rise = s.counters[c] - old[c]
                # A fall is a reset (perfquery -R, a driver reload): a new baseline.
                if rise >= limit:
                    jumps.append(f"{c} +{rise}")
        if not jumps:
            return ""
        return f"port {s.port} {', '.join(jumps)} in {now - then:.0f}s"

    def gone(self) -> frozenset[str]:
        """The HCAs whose ports folder is gone from sysfs now."""
        return frozenset(h for h, lines in self._problems.items() if GONE in lines)

    def apply(self, inv: Inventory) -> Inventory:
        """`inv` with each HCA's problems as seen now."""
        if not inv.hcas:
            return inv
        hcas = tuple(evolve(h, problems=self._problems.get(h.name, ())) for h in inv.hcas)
        return inv if hcas == inv.hcas else evolve(inv, hcas=hcas)


def without_hcas(config: AgentConfig, gone: frozenset[str]) -> AgentConfig:
    """`config` with the HCAs in `gone` left out of its fabrics, so that discovery, which
    refuses a labelled HCA that is absent (a wrong label), can still read the rest after
    one left sysfs while the agent runs (a firmware reset, a driver reload)."""
    fabrics = tuple(evolve(f, hcas=tuple(h for h in f.hcas if h not in gone)) for f in config.fabrics)
    return evolve(config, fabrics=fabrics)


def with_gone(inv: Inventory, config: AgentConfig, gone: frozenset[str]) -> Inventory:
    """`inv` (discovered without the HCAs in `gone`) with each of them back as an HCA
    that is not found, and each fabric listing its configured HCAs again: the server sees
    the HCA unhealthy (its replicas move) rather than not at all."""
    have = {h.name for h in inv.hcas}
    missing = tuple(Hca(name=h, node_guid="", problems=(GONE,)) for h in sorted(gone) if h not in have)
    labels = {f.name: f.hcas for f in config.fabrics}
    fabrics = []
    for f in inv.fabrics:
        hcas = labels.get(f.name, f.hcas)
        state = f.state
        if state is FabricState.UP and set(hcas) & gone:
            state = FabricState.DEGRADED
        fabrics.append(evolve(f, hcas=hcas, state=state))
    return evolve(inv, hcas=(*inv.hcas, *missing), fabrics=tuple(fabrics))


async def serve_hca_watch(
    ib_root: str,
    hcas: tuple[str, ...],
    health: HcaHealth,
    on_change: Callable[[], None],
    interval: float,
    *,
    read: Callable[[str, tuple[str, ...]], Awaitable[tuple[PortSample, ...]]] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Read `hcas`' ports every `interval` seconds into `health`; `on_change` (on the
    event loop, must not block) when some HCA's problems changed. No HCAs: returns.
    `read`: how a round is read (default: read_samples in a thread)."""
    task_status.started()
    if not hcas:
        return
    while True:
        if read is None:
            samples = await trio.to_thread.run_sync(read_samples, ib_root, hcas)
        else:
            samples = await read(ib_root, hcas)
        before = health.problems
        if health.observe(samples, trio.current_time()):
            after = health.problems
            for h in hcas:
                if after.get(h) == before.get(h):
                    continue
                if after.get(h):
                    log.error("HCA %s: %s; not counted in its fabric until it is ACTIVE and "
                              "quiet again", h, "; ".join(after[h]))
                else:
                    log.info("HCA %s: ACTIVE and quiet again", h)
            on_change()
        await trio.sleep(interval)
