"""A two-member mp replica on two agents' supervisors on loopback: ready only when both
members are up, and rank 0 goes down when rank 1 dies, as a real gang does."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from fakes.engines import free_port
from fakes.live import engine_pids, kill_engines
from fakes.supervision import FakeGpus, Reports, gpu
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.model.engine import EngineKind, EngineSpec, EngineState, GangSpec

FAST = {"LLMGW_SIM_TTFT": "0.01", "LLMGW_SIM_TOKENS_PER_SECOND": "1000"}


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    kill_engines(tmp_path)


def member(rank: int, rendezvous: int, port: int) -> EngineSpec:
    return EngineSpec(
        "gang-0", 7, "gang", "org/sim", "gang-model", EngineKind.SIMULATED, (f"GPU-{rank}",), port,
        env=FAST, startup_timeout=30,
        gang=GangSpec(nnodes=2, rank=rank, head_addr="127.0.0.1", rendezvous_port=rendezvous),
    )


async def test_mp_gang_ready_only_with_both_members_and_dies_with_rank_1(root: Path) -> None:
    rendezvous = free_port()
    head, other = Reports(), Reports()
    # Each node's one GPU, as its NVML would read it (CUDA device 0 on both).
    sup0 = Supervisor(config(str(root / "node-0")), head, gpu_memory=FakeGpus(gpu("GPU-0", 0)))
    sup1 = Supervisor(config(str(root / "node-1")), other, gpu_memory=FakeGpus(gpu("GPU-1", 0)))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup0.serve)
        await nursery.start(sup1.serve)
        await sup0.apply((member(0, rendezvous, free_port()),))
        # Rank 0 alone waits at its rendezvous and never answers health.
        await trio.sleep(2.0)
        assert EngineState.READY not in head.states()
        await sup1.apply((member(1, rendezvous, free_port()),))
        await head.wait("gang-0", EngineState.READY, 20)
        (rank1_pid,) = [pid for pid, tag in engine_pids(root / "node-1").items()
                        if tag.startswith("gang-0")]
        os.kill(rank1_pid, signal.SIGKILL)
        await other.wait("gang-0", EngineState.EXITED, 20)
        # The head loses its gang: its health fails and it is reported, then it exits.
        bad = await head.wait("gang-0", EngineState.UNHEALTHY, 20)
        assert bad.replica_id == "gang-0"
        await sup0.apply(())
        await sup1.apply(())
        nursery.cancel_scope.cancel()
    assert not engine_pids(root)
