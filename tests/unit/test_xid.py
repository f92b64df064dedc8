"""The Xid watcher over the fake NVML's event set, and the pure table and holder."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import pytest
import trio

from fakes.nvidia_smi import BUSES, NVML_ERROR_UNKNOWN, FakeNvml, FakeNVMLError
from llmgw.agent.discovery.gpu_health import HealthReading
from llmgw.agent.gpus.memory import GpuMemory
from llmgw.agent.gpus.xid import SOFT_XIDS, UNHEALTHY_XIDS, XidProblems, serve_xid_watch, xid_problem
from llmgw.model.inventory import Gpu, Inventory, is_soft

AT = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)


def test_table_marks_hardware_faults_and_ignores_application_faults() -> None:
    assert xid_problem(79, AT) == "Xid 79 at 2026-12-01T10:00:00Z: GPU has fallen off the bus"
    assert xid_problem(48, AT) == "Xid 48 at 2026-12-01T10:00:00Z: double bit ECC error"
    for xid in (13, 31, 43, 45, 0, 99999):
        assert xid_problem(xid, AT) is None
    assert {48, 63, 64, 74, 79, 94, 95, 119, 120, 140} == set(UNHEALTHY_XIDS)


async def watch(nvml: FakeNvml, want: int, max_waits: int = 5000,
                unresolved: list[int] | None = None) -> list[tuple[str, str]]:
    """Run the watch until `want` problems came, or it has waited `max_waits` times
    (the guard: a deadline would not do, as the autojump clock jumps to it while the
    watch's thread runs). Problems go through an XidProblems, as in the agent."""
    got: list[tuple[str, str]] = []
    xp = XidProblems()

    def on_problem(uuid: str, problem: str) -> bool:
        new = xp.add(uuid, problem)
        if new:
            got.append((uuid, problem))
        return new

    def on_unresolved(xid: int) -> None:
        if unresolved is not None:
            unresolved.append(xid)

    async with trio.open_nursery() as n:
        await n.start(lambda task_status: serve_xid_watch(nvml, on_problem, on_unresolved=on_unresolved,
                                                            now=lambda: AT, task_status=task_status))
        while len(got) < want and nvml.waits < max_waits:
            await trio.sleep(0.01)
        n.cancel_scope.cancel()
    return got


async def test_unhealthy_xids_are_reported_once_per_gpu(autojump_clock: trio.abc.Clock) -> None:
    nvml = FakeNvml(BUSES, uuids=["GPU-d", "GPU-c", "GPU-b", "GPU-a"],
                    xids=[(0, 13), (0, 79), (1, 31), (0, 79), (2, 48), (2, 94)])
    got = await watch(nvml, 3)
    assert got == [
        ("GPU-d", "Xid 79 at 2026-12-01T10:00:00Z: GPU has fallen off the bus"),
        ("GPU-b", "Xid 48 at 2026-12-01T10:00:00Z: double bit ECC error"),
        ("GPU-b", "no new work: Xid 94 at 2026-12-01T10:00:00Z: contained ECC error"),
    ]
    assert {h for h, _ in nvml.registered} == {0, 1, 2, 3}
    assert all(t == FakeNvml.nvmlEventTypeXidCriticalError for _, t in nvml.registered)
    assert (nvml.inits, nvml.shutdowns, nvml.event_sets_freed) == (1, 1, 1)


async def test_gpus_that_cannot_register_are_skipped(autojump_clock: trio.abc.Clock) -> None:
    nvml = FakeNvml(BUSES, lost={1}, xid_unsupported={2}, xids=[(3, 79)])
    got = await watch(nvml, 1)
    assert [u for u, _ in got] == ["GPU-0003"]
    assert {h for h, _ in nvml.registered} == {0, 3}


async def test_no_event_api_logs_once_and_returns(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml(BUSES, events_api=False)
    with caplog.at_level(logging.INFO, logger="llmgw.agent.gpus.xid"):
        async with trio.open_nursery() as n:
            await n.start(serve_xid_watch, nvml, lambda _u, _p: None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "Xid errors are not watched" in lines[0]
    assert (nvml.inits, nvml.shutdowns, nvml.waits) == (1, 1, 0)


async def test_no_gpu_supporting_events_returns() -> None:
    nvml = FakeNvml(BUSES[:2], xid_unsupported={0, 1})
    await serve_xid_watch(nvml, lambda _u, _p: None)
    assert (nvml.shutdowns, nvml.event_sets_freed, nvml.waits) == (1, 1, 0)


async def test_no_nvml_returns_at_once() -> None:
    await serve_xid_watch(None, lambda _u, _p: None)
    await serve_xid_watch(FakeNvml(BUSES, fail_init=True), lambda _u, _p: None)


class FlakyWait(FakeNvml):
    """The wait fails twice (a GPU falling off the bus can do that), then events flow."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.failures = 2

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        if self.failures:
            self.failures -= 1
            raise FakeNVMLError(NVML_ERROR_UNKNOWN)
        return super().nvmlEventSetWait_v2(event_set, timeout_ms)


async def test_wait_errors_back_off_and_the_watch_goes_on(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    nvml = FlakyWait(BUSES, xids=[(1, 119)])
    start = trio.current_time()
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.gpus.xid"):
        got = await watch(nvml, 1)
    assert got == [("GPU-0001", "Xid 119 at 2026-12-01T10:00:00Z: GSP RPC timeout")]
    assert trio.current_time() - start >= 10  # two backoffs, no spinning on the error
    assert len([r for r in caplog.records if "waiting for NVML events failed" in r.getMessage()]) == 1


def gpu(uuid: str, problems: tuple[str, ...] = ()) -> Gpu:
    return Gpu(index=0, uuid=uuid, name="x", memory_total=1, memory_free=1, pci_bus_id=BUSES[0],
               problems=problems)


def test_xid_problems_apply_to_the_inventory_and_memory() -> None:
    xp = XidProblems()
    inv = Inventory(gpus=(gpu("GPU-a", ("MIG mode is on (llmgw places whole GPUs)",)), gpu("GPU-b")))
    assert not xp and xp.apply(inv) is inv
    p79 = xid_problem(79, AT)
    assert p79 is not None
    assert xp.add("GPU-a", p79) and not xp.add("GPU-a", p79)
    assert xp.of("GPU-a") == (p79,) and xp.of("GPU-b") == ()
    out = xp.apply(inv)
    assert out.gpus[0].problems == ("MIG mode is on (llmgw places whole GPUs)", p79)
    assert out.gpus[1] is inv.gpus[1]
    assert xp.apply(out) == out  # applying twice adds nothing
    mem = {"GPU-a": GpuMemory("GPU-a", 0, 1, 1), "GPU-b": GpuMemory("GPU-b", 1, 1, 1)}
    applied = xp.apply_memory(mem)
    assert applied["GPU-a"].problems == (p79,) and applied["GPU-b"] is mem["GPU-b"]


def test_xid_problems_are_bounded_per_gpu() -> None:
    xp = XidProblems()
    for k in range(10):
        xp.add("GPU-a", f"Xid {k}")
    assert len(xp.of("GPU-a")) == XidProblems.MAX_PER_GPU


def test_remap_recording_and_contained_ecc_xids_are_soft() -> None:
    """Xid 63 is the driver noting a pending remap ("reset gpu to activate"), 94 an ECC
    error contained to its process: neither moves what runs on the GPU."""
    assert SOFT_XIDS == {63, 94}
    for xid in UNHEALTHY_XIDS:
        line = xid_problem(xid, AT)
        assert line is not None and is_soft(line) == (xid in SOFT_XIDS)
    assert not Gpu(0, "GPU-a", "", 0, 0, "", problems=(xid_problem(63, AT) or "",)).placeable
    assert Gpu(0, "GPU-a", "", 0, 0, "", problems=(xid_problem(63, AT) or "",)).healthy


async def test_an_xid_whose_device_is_not_resolved_rereads_every_gpu(autojump_clock: trio.abc.Clock) -> None:
    """Before issue 30 such an event was kept for a GPU named "unknown", which no GPU is:
    dropped. Now it asks for every GPU to be read again, and the watch goes on."""
    nvml = FakeNvml(BUSES, xids=[(-1, 79), (2, 48)])
    unresolved: list[int] = []
    got = await watch(nvml, 1, unresolved=unresolved)
    assert unresolved == [79]
    assert got == [("GPU-0002", "Xid 48 at 2026-12-01T10:00:00Z: double bit ECC error")]


def test_an_xid_clears_once_the_readings_show_a_reset() -> None:
    xp = XidProblems()
    p79 = xid_problem(79, AT) or ""
    assert xp.add("GPU-a", p79) and xp.add("GPU-b", xid_problem(48, AT) or "")
    # After the Xid: GPU-a lost, GPU-b with a pending remap and a reset asked for.
    assert xp.observe({"GPU-a": HealthReading(lost=True),
                       "GPU-b": HealthReading(remapped_rows=(0, 1, 1, 0), recovery_action=1)}) == ()
    assert xp.observe({"GPU-a": HealthReading(lost=True),
                       "GPU-b": HealthReading(remapped_rows=(0, 1, 1, 0), recovery_action=0)}) == ()
    # GPU-a is readable again, GPU-b's remap applied: both were reset.
    assert xp.observe({"GPU-a": HealthReading(mig_current=0),
                       "GPU-b": HealthReading(remapped_rows=(0, 1, 0, 0), recovery_action=0)}) == ("GPU-a", "GPU-b")
    assert not xp and xp.of("GPU-a") == ()
    inv = Inventory(gpus=(gpu("GPU-a"),))
    assert xp.apply(inv) is inv
    # The same Xid again later counts again.
    assert xp.add("GPU-a", p79)


def test_an_xid_without_reset_evidence_stays_until_the_operator_clears_it() -> None:
    xp = XidProblems()
    p74 = xid_problem(74, AT) or ""
    xp.add("GPU-a", p74)
    for _ in range(3):
        assert xp.observe({"GPU-a": HealthReading(remapped_rows=(0, 0, 0, 0), recovery_action=0)}) == ()
    assert xp.of("GPU-a") == (p74,)
    assert xp.clear("GPU-a") == (p74,) and xp.clear("GPU-a") == ()
    assert xp.of("GPU-a") == ()


def test_one_line_per_xid_number() -> None:
    xp = XidProblems()
    later = AT.replace(hour=11)
    assert xp.add("GPU-a", xid_problem(79, AT) or "")
    assert not xp.add("GPU-a", xid_problem(79, later) or "")
    assert xp.add("GPU-a", xid_problem(48, later) or "")


def test_a_reset_must_follow_the_latest_xid() -> None:
    xp = XidProblems()
    xp.add("GPU-a", xid_problem(79, AT) or "")
    xp.observe({"GPU-a": HealthReading(lost=True)})
    p48 = xid_problem(48, AT) or ""
    xp.add("GPU-a", p48)  # a new Xid: the loss seen before it proves nothing of a later reset
    assert xp.observe({"GPU-a": HealthReading(mig_current=0)}) == ()
    assert len(xp.of("GPU-a")) == 2
