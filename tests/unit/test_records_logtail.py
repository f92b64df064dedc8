from __future__ import annotations

import os
from pathlib import Path

from llmgw.agent.lifecycle.logtail import tail_lines
from llmgw.agent.lifecycle.records import EngineRecord, read_records, remove_record, write_record
from llmgw.agent.process.procs import rotate_log
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec


def spec(rid: str) -> EngineSpec:
    return EngineSpec(rid, 7, "dep", "org/m", "m", EngineKind.VLLM, ("GPU-1",), 20001,
                      env={"A": "1"}, gang=GangSpec(2, 1, "10.0.0.1", 29501, ("mlx5_0",)))


def test_record_round_trip_and_remove(tmp_path: Path) -> None:
    rec = EngineRecord(spec("r1"), "/x/engine.log", ports=(20001,))
    write_record(str(tmp_path), rec)
    assert read_records(str(tmp_path)) == [rec]
    assert rec.pending
    done = rec.completed(123, 123, 456)
    write_record(str(tmp_path), done)
    assert read_records(str(tmp_path)) == [done]
    assert not done.pending
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "engines" / "r1").iterdir())
    remove_record(str(tmp_path), "r1")
    remove_record(str(tmp_path), "r1")
    assert read_records(str(tmp_path)) == []


def test_corrupt_record_is_skipped_not_deleted(tmp_path: Path) -> None:
    write_record(str(tmp_path), EngineRecord(spec("good"), "l"))
    bad = tmp_path / "engines" / "bad" / "record.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    assert [r.spec.replica_id for r in read_records(str(tmp_path))] == ["good"]
    assert bad.exists()


def test_tail_lines(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    assert tail_lines(str(log), 5) == ()
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert tail_lines(str(log), 3) == ("line 99997", "line 99998", "line 99999")
    assert tail_lines(str(log), 0) == ()
    log.write_text("a\nb\nno newline at end")
    assert tail_lines(str(log), 2) == ("b", "no newline at end")
    assert tail_lines(str(log), 10) == ("a", "b", "no newline at end")
    log.write_bytes(b"x" * 100 + b"\n\xff\xfe bad bytes\n")
    assert tail_lines(str(log), 1) == ("\ufffd\ufffd bad bytes",)


def test_tail_lines_bounded_read(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"y" * 300_000 + b"\nlast\n")
    assert tail_lines(str(log), 5, max_bytes=100_000) == ("last",)


def test_rotate_log(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    rotate_log(str(log), 10)  # missing: nothing to do
    log.write_text("small")
    rotate_log(str(log), 10)
    assert log.read_text() == "small"
    log.write_text("x" * 20)
    (tmp_path / "engine.log.1").write_text("older")
    rotate_log(str(log), 10)
    assert not log.exists()
    assert (tmp_path / "engine.log.1").read_text() == "x" * 20
    assert os.listdir(tmp_path) == ["engine.log.1"]
