"""Raise the soft limit on open files to the hard limit, at a daemon's start.

A router holds two descriptors per stream in flight (the client's and the engine's), and
the server one per peer socket and then some; a shell's common soft limit of 1024 runs the
router out at about 500 concurrent streams, whatever the hard limit allows. A systemd
unit's `LimitNOFILE` covers only the unit: started by hand, the daemon raises its own.

`raise_nofile` is the whole policy: get, decide, set, with the two calls passed in (tests
give fakes); it never raises, since a limit it cannot raise is something to log, not a
reason not to start.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable

log = logging.getLogger("llmgw.rlimit")

# When the hard limit is unlimited, the kernel still refuses more than fs.nr_open
# (1,048,576 by default) for RLIMIT_NOFILE: ask for that.
UNLIMITED_TARGET = 1 << 20

Get = Callable[[int], tuple[int, int]]
Set = Callable[[int, tuple[int, int]], None]


def target(soft: int, hard: int) -> int:
    """The soft limit to ask for: the hard one (bounded when unlimited), never lower."""
    want = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY or hard < 0 else hard
    if soft != resource.RLIM_INFINITY and soft >= 0 and soft >= want:
        return soft
    if soft == resource.RLIM_INFINITY:
        return soft
    return want


def raise_nofile(
    who: str,
    getrlimit: Get = resource.getrlimit,
    setrlimit: Set = resource.setrlimit,
) -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit and log the figure; returns the
    soft limit now in force. `who`: the daemon, for the log line."""
    try:
        soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError) as exc:
        log.warning("%s: cannot read the open-file limit: %s", who, exc)
        return -1
    want = target(soft, hard)
    if want != soft:
        try:
            setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as exc:
            log.warning(
                "%s: open-file limit stays %d (hard %d): raising it failed: %s", who, soft, hard, exc
            )
            return soft
        log.info("%s: open-file limit raised from %d to %d (the hard limit)", who, soft, want)
        return want
    log.info("%s: open-file limit %d (hard %d)", who, soft, hard)
    return soft
