"""A real PostgreSQL for tests: Debian's `postgresql` package, a throwaway cluster in a
temporary directory, listening on a unix socket there (and on 127.0.0.1 at a free port).

CI runs as root and PostgreSQL refuses to run as root, so as root the cluster belongs to
the `postgres` user the package creates (or `nobody`). Stopped, by its pid, at the end.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from fakes.engines import free_port

HOW_TO_GET = "PostgreSQL is not installed: apt-get install postgresql"


def pg_bin() -> Path | None:
    """The folder of initdb and pg_ctl, or None."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(os.path.realpath(found)).parent
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), reverse=True):
        return Path(cand).parent
    return None


def _run_as() -> list[str]:
    if os.geteuid() != 0:
        return []
    for user in ("postgres", "nobody"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            continue
        return ["runuser", "-u", user, "--"]
    raise RuntimeError("running as root with neither a postgres nor a nobody user")


class PgServer:
    """One PostgreSQL cluster; `url(db)` for a database in it, `new_database()` for a
    fresh one per test."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.prefix = _run_as()
        if self.prefix:
            os.chown(self.dir, pwd.getpwnam(self.prefix[2]).pw_uid, -1)
        self._sh("initdb", "-D", str(self.data), "-A", "trust", "-U", "llmgw", "--no-sync",
                 "-E", "UTF8", "--no-instructions")
        self.start()

    def _sh(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.prefix, str(self.bin / tool), *args], capture_output=True,
                              text=True, timeout=60, check=check, cwd=self.dir)

    def start(self) -> None:
        # fsync off: writes still reach the page cache, so an immediate shutdown (a crash
        # of PostgreSQL, not of the machine) loses nothing; synchronous_commit stays on.
        opts = (f"-k {self.dir} -p {self.port} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c max_connections=200")
        r = self._sh("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"),
                     "-w", "-t", "30", "start", check=False)
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {r.stdout}{r.stderr}\n{self.log()}")

    def stop(self, mode: str = "fast") -> None:
        r = self._sh("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop",
                     check=False)
        if r.returncode != 0 and self.pid():
            pid = self.pid()
            if pid:
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.5)

    def restart(self, down_for: float = 0.0) -> None:
        """An abrupt restart: every connection is cut (immediate shutdown), then it is back."""
        self.stop("immediate")
        time.sleep(down_for)
        self.start()

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def log(self) -> str:
        try:
            return (self.dir / "log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://llmgw@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
        return self.url(name)

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

