"""A download's progress (issue 23): bytes on disk under the HF cache's blobs/, the rate,
one line for describe; the startup deadline counting that growth; and the supervisor
reporting it while a simulated engine with no copy on its node starts."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import trio

from fakes.engines import free_port
from fakes.supervision import Reports
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle.download_progress import DownloadProgress, downloaded, read_listing, repo_dir
from llmgw.agent.lifecycle.startup_deadline import StartupDeadline
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.model.engine import EngineKind, EngineSpec, EngineState
from llmgw.model.inventory import StorageReport


def test_repo_dir_is_the_hub_layout() -> None:
    assert repo_dir("/data/dl", "meta-llama/Llama-3.1-70B") == "/data/dl/models--meta-llama--Llama-3.1-70B"


def test_bytes_count_incomplete_files_and_not_unreadable_ones() -> None:
    assert downloaded([("a", 10), ("b.incomplete", 5), ("c", -1)]) == 15
    assert downloaded([]) == 0


def test_rate_is_between_the_last_two_samples() -> None:
    p = DownloadProgress.start(0, 0.0)
    assert p.line() == ""  # nothing yet: nothing said
    p = p.observe(2_000_000_000, 10.0)
    assert p.rate == 200e6
    assert p.line() == "2.0 GB on disk, 200.0 MB/s"
    p = p.observe(2_000_000_000, 15.0)
    assert p.line() == "2.0 GB on disk, 0 B/s"
    assert p.observe(3, 15.0).rate == 0.0  # no time passed: the rate stands


def test_a_copy_already_there_that_does_not_grow_says_its_size() -> None:
    p = DownloadProgress.start(5_500_000, 0.0).observe(5_500_000, 2.0)
    assert not p.started
    assert p.line() == "5.5 MB on disk, 0 B/s"


def test_reader_lists_blobs_and_a_missing_folder_is_empty(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--x"
    assert read_listing(str(repo)) == []
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc.incomplete").write_bytes(b"x" * 7)
    (repo / "blobs" / "def").write_bytes(b"x" * 3)
    assert sorted(read_listing(str(repo))) == [("abc.incomplete", 7), ("def", 3)]


def test_download_growth_extends_the_startup_deadline() -> None:
    d = StartupDeadline.start(0.0, 60.0, cap=3600.0, log_size=100, downloaded=0)
    d = d.observe(100, 50.0, 1_000_000)  # the log still, the download grew
    assert d.deadline == 110.0
    d = d.observe(100, 100.0, 1_000_000)  # neither moved
    assert d.deadline == 110.0
    assert d.expired(111.0).endswith("(no progress for 61s)")


async def test_supervisor_reports_the_bytes_on_disk(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    dl = tmp_path / "dl"
    cfg = attrs.evolve(config(str(work)), download_dir=str(dl))
    # Loading for longer than the test: it stays STARTING while "downloading".
    spec = EngineSpec("r1", 1, "tiny", "org/tiny", "tiny", EngineKind.SIMULATED, (), free_port(),
                      env={"LLMGW_SIM_LOAD_SECONDS": "60"})
    reports = Reports()
    sup = Supervisor(cfg, reports, storage=lambda: StorageReport(True, ()))
    sup.health.download_report_every = 0.2
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        first = await reports.wait("r1", EngineState.STARTING)
        assert first.download == ""
        assert "downloading into" in first.weights
        blobs = dl / "models--org--tiny" / "blobs"
        os.makedirs(blobs)
        (blobs / "abc.incomplete").write_bytes(b"x" * 3_000_000)
        with trio.fail_after(10):
            while not any(r.download.startswith("3.0 MB on disk") for r in reports.seen):
                await trio.sleep(0.05)
        await sup.apply(())
        await reports.wait("r1", EngineState.EXITED)
        nursery.cancel_scope.cancel()


async def test_a_growing_download_keeps_a_quiet_engine_starting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1.5 s of startup_timeout, an engine that logs nothing while it "loads": it lives on
    for as long as its download grows, and is given up on once that stops."""
    dl = tmp_path / "dl"
    cfg = attrs.evolve(config(str(tmp_path / "work")), download_dir=str(dl))
    spec = EngineSpec("r2", 1, "tiny", "org/tiny", "tiny", EngineKind.SIMULATED, (), free_port(),
                      env={"LLMGW_SIM_LOAD_SECONDS": "60"}, startup_timeout=1.5)
    reports = Reports()
    sup = Supervisor(cfg, reports, storage=lambda: StorageReport(True, ()))
    sup.health.download_report_every = 0.2
    blob = dl / "models--org--tiny" / "blobs" / "abc.incomplete"
    os.makedirs(blob.parent)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        await reports.wait("r2", EngineState.STARTING)
        for _ in range(16):  # 4.8 s, three times the timeout
            with blob.open("ab") as f:
                f.write(b"x" * 100_000)
            await trio.sleep(0.3)
        assert all(r.state is EngineState.STARTING for r in reports.seen if r.replica_id == "r2")
        with trio.fail_after(10):
            while not any("no progress" in r.reason for r in reports.seen):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
