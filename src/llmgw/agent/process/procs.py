"""Engine processes at the OS level: spawn in a new session, find, signal, wait.

Everything here works by pid, session id and /proc — never by process name, since other
replicas' processes (Ray's especially) share the node under the same names.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

import trio

from llmgw.agent.discovery.procnet import session_of_stat, stat_fields

log = logging.getLogger(__name__)

REPLICA_ENV = "LLMGW_REPLICA_ID"


class _Detached(subprocess.Popen[bytes]):
    """A Popen that does not warn when dropped: engines outlive their Popen object.

    The supervisor reaps its children itself (pidfd + waitpid), so Popen's own
    bookkeeping of unfinished children is not wanted.
    """

    def __del__(self) -> None:  # noqa: D105 - intentionally silent
        return


def replica_tag(replica_id: str, generation: int) -> str:
    return f"{replica_id}:{generation}"


def rotate_log(path: str, max_bytes: int) -> None:
    """Move `path` to `path.1` (replacing it) when it is over `max_bytes`."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return
    if size > max_bytes:
        os.replace(path, path + ".1")


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None,
    log_path: str,
    new_session: bool = True,
) -> int:
    """Start `argv` with stdout and stderr appended to `log_path`; returns the pid.

    stdin is /dev/null. The process gets a new session (its own session id = its pid)
    so that it outlives the agent and can be signalled as a group.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        proc = _Detached(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=new_session,
            close_fds=True,
        )
    finally:
        os.close(fd)
    return proc.pid


def _stat_text(pid: int) -> str:
    """/proc/<pid>/stat; "" if gone. Parsed by discovery/procnet's pure functions."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat from field 3 (state) on; None if gone."""
    return stat_fields(_stat_text(pid))


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); None if gone or a zombie."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def session_of(pid: int) -> int | None:
    return session_of_stat(_stat_text(pid))


def alive_as(pid: int, started: int) -> bool:
    """True when `pid` is alive and is the process that started at `started`."""
    return pid > 0 and start_time(pid) == started


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def session_pids(sid: int) -> list[int]:
    """Every live (non-zombie) process whose session id is `sid`."""
    out = []
    for pid in _all_pids():
        if session_of_stat(_stat_text(pid)) == sid:
            out.append(pid)
    return out


def sessions_pids(sids: frozenset[int]) -> dict[int, list[int]]:
    """The live processes of each session in `sids`, in one walk of /proc."""
    out: dict[int, list[int]] = {sid: [] for sid in sids}
    if not sids:
        return out
    for pid in _all_pids():
        sid = session_of_stat(_stat_text(pid))
        if sid is not None and sid in out:
            out[sid].append(pid)
    return out


def state_of(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, D, Z, ...); None when gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def pids_with_env(key: str, value: str) -> list[int]:
    """Live processes whose environment holds key=value (ours only: others are unreadable)."""
    needle = f"{key}={value}".encode()
    out = []
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        if needle in entries and start_time(pid) is not None:
            out.append(pid)
    return out


def signal_session(sid: int, sig: int) -> int:
    """Send `sig` to every live process in session `sid`; returns how many were sent."""
    sent = 0
    for pid in session_pids(sid):
        try:
            os.kill(pid, sig)
            sent += 1
        except ProcessLookupError:
            continue
        except PermissionError as exc:
            log.warning("cannot signal pid %d in session %d: %s", pid, sid, exc)
    return sent


def try_reap(pid: int) -> int | None:
    """Reap `pid` if it is our exited child; its exit code (-N for signal N), else None."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if got == 0:
        return None
    return os.waitstatus_to_exitcode(status)


async def wait_exit(pid: int, started: int) -> int | None:
    """Wait until `pid` (the process that started at `started`) exits.

    Returns its exit code when it was our child, else None (an adopted process: the
    kernel tells only its parent). Works for non-children through a pidfd. Returns at
    once if `pid` is already gone or now names another process.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return try_reap(pid)
    try:
        # Opened first, checked second: the pidfd now pins this very process.
        if start_time(pid) == started:
            await trio.lowlevel.wait_readable(pidfd)
    finally:
        trio.lowlevel.notify_closing(pidfd)
        os.close(pidfd)
    # A readable pidfd means the process is a zombie or gone; reap it if it is ours.
    for _ in range(50):
        code = try_reap(pid)
        if code is not None or start_time(pid) != started:
            return code
        await trio.sleep(0.01)
    return None


async def _until_empty(sid: int, poll: float) -> None:
    while True:
        if not session_pids(sid):
            return
        await trio.sleep(poll)


async def stop_session(sid: int, timeout: float) -> bool:
    """SIGTERM session `sid`, wait up to `timeout` for it to empty, then SIGKILL what is left.

    Returns True when SIGKILL was needed. Never touches a process outside the session.
    """
    signal_session(sid, signal.SIGTERM)
    with trio.move_on_after(timeout):
        await _until_empty(sid, 0.05)
        return False
    killed = signal_session(sid, signal.SIGKILL) > 0
    with trio.move_on_after(5):
        await _until_empty(sid, 0.02)
    return killed
