"""`llmgw` whose PostgreSQL store can stop its own process inside a fenced transaction, as
a frozen VM would stop a leader mid-write (tests/integration/test_frozen_leader.py).

    python tests/fakes/frozen_server.py FREEZE_FILE server --config server.toml

FREEZE_FILE, once written, holds an SQL prefix: the first statement of a fenced
transaction that starts with it stops this process (SIGSTOP) before it runs; the file is
removed first, so the freeze happens once. The hook reaches the store through PgStore's
`before_statement`: production code reads no test file.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from llmgw.server.store import postgres

log = logging.getLogger("llmgw.test.freeze")


def freeze_hook(path: str) -> Callable[[str], None]:
    def before(sql: str) -> None:
        try:
            with open(path) as f:
                prefix = f.read().strip()
            if not prefix or not sql.startswith(prefix):
                return
            os.unlink(path)
        except OSError:
            return  # not armed yet
        log.warning("test hook: stopping inside a fenced transaction before %s", sql[:60])
        os.kill(os.getpid(), signal.SIGSTOP)
    return before


def main(argv: list[str]) -> int:
    freeze_file, args = argv[0], argv[1:]
    real = postgres.PgStore

    class FreezingPgStore(real):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, before_statement=freeze_hook(freeze_file), **kw)

    # Before the server's modules import the class by name.
    postgres.PgStore = FreezingPgStore
    from llmgw import cli
    from llmgw.server.store import leadership

    assert leadership.PgStore is FreezingPgStore, "leadership.py was imported before the hook"
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
