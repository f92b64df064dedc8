"""Adoption at agent start: match engine records against the processes that live now.

A completed record whose pid is alive with the recorded start time is adopted. A pending
record (the agent died between writing it and completing it) is completed from the
process carrying its LLMGW_REPLICA_ID tag, if one exists. A pid that now names another
process is never signalled.
"""

from __future__ import annotations

import logging

import trio
from attrs import frozen

from llmgw.agent.lifecycle.records import EngineRecord, read_records, remove_record, write_record
from llmgw.agent.process import procs

log = logging.getLogger(__name__)

# A spawn interrupted by the agent's death may still be between fork and exec, when its
# environment does not yet carry the tag: look again once after this long.
PENDING_RESCAN = 0.3
STOP_STRAY_TIMEOUT = 5.0


@frozen
class Adopted:
    record: EngineRecord


@frozen
class Gone:
    record: EngineRecord
    reason: str


def _tagged_leaders(record: EngineRecord) -> list[int]:
    tag = procs.replica_tag(record.spec.replica_id, record.spec.generation)
    pids = procs.pids_with_env(procs.REPLICA_ENV, tag)
    return [p for p in pids if procs.session_of(p) == p]


async def _resolve_pending(work_dir: str, record: EngineRecord) -> Adopted | None:
    leaders = _tagged_leaders(record)
    if not leaders:
        return None
    started = {p: procs.start_time(p) for p in leaders}
    leaders = sorted((p for p in leaders if started[p] is not None), key=lambda p: started[p] or 0)
    if not leaders:
        return None
    keep, extra = leaders[0], leaders[1:]
    for pid in extra:  # cannot happen with one spawn per pending record; never keep two
        log.warning("replica %s: stopping duplicate engine session %d", record.spec.replica_id, pid)
        await procs.stop_session(pid, STOP_STRAY_TIMEOUT)
    done = record.completed(keep, keep, started[keep] or 0)
    write_record(work_dir, done)
    log.info("replica %s: completed pending record with pid %d", record.spec.replica_id, keep)
    return Adopted(done)


def _check(record: EngineRecord) -> Adopted | Gone | None:
    """Adopted or Gone for a completed record; None when its pid is free but its
    session still has members (the caller stops them: they can only be the engine's)."""
    if procs.alive_as(record.pid, record.start_time):
        return Adopted(record)
    if procs.start_time(record.pid) is not None:
        return Gone(record, f"pid {record.pid} now belongs to another process (not signalled)")
    if procs.session_pids(record.sid):
        return None
    return Gone(record, "exited while the agent was away (exit code unknown)")


async def adopt_records(work_dir: str) -> list[Adopted | Gone]:
    out: list[Adopted | Gone] = []
    pending: list[EngineRecord] = []
    for record in read_records(work_dir):
        if record.pending:
            found = await _resolve_pending(work_dir, record)
            if found is None:
                pending.append(record)
            else:
                out.append(found)
            continue
        checked = _check(record)
        if checked is None:
            log.warning("replica %s: engine gone, stopping what is left of session %d",
                        record.spec.replica_id, record.sid)
            await procs.stop_session(record.sid, STOP_STRAY_TIMEOUT)
            checked = Gone(record, "exited while the agent was away (exit code unknown)")
        out.append(checked)
    if pending:
        await trio.sleep(PENDING_RESCAN)
        for record in pending:
            found = await _resolve_pending(work_dir, record)
            if found is None:
                log.info("replica %s: pending record without a process, removed",
                         record.spec.replica_id)
                remove_record(work_dir, record.spec.replica_id)
            else:
                out.append(found)
    return out
