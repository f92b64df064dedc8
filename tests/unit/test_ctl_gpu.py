"""`ctl gpu clear NODE GPU` (issue 30 item 3): the command line into a GpuClearOp, the
server finding the GPU by index or UUID, the agent's link handing ClearGpu on."""

from __future__ import annotations

import argparse

import pytest
import trio

from llmgw.agent.link import LinkHooks, LinkSettings, _Session
from llmgw.cli import build_parser
from llmgw.ctl import commands, gpu
from llmgw.errors import UsageError
from llmgw.model.inventory import Gpu, soft
from llmgw.server.gpu_clear import find_gpu, is_xid
from llmgw.transport.gpu_ops import GpuClearOp
from llmgw.transport.messages import ClearGpu, DesiredSet, Hello


def parse(*argv: str) -> argparse.Namespace:
    return commands.normalize(build_parser().parse_args(["ctl", *argv]))


def test_the_command_line_is_one_op() -> None:
    assert commands.op_of(parse("gpu", "clear", "n3", "2")) == GpuClearOp("n3", "2")
    assert commands.op_of(parse("gpu", "clear", "n3", "GPU-abc", "-o", "json")) == GpuClearOp("n3", "GPU-abc")


def test_no_verb_or_a_bad_name_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="expected a verb: clear"):
        commands.op_of(parse("gpu"))
    with pytest.raises(UsageError, match="ctl gpu clear: gpu: expected 1 to 128"):
        commands.op_of(parse("gpu", "clear", "n3", "x" * 200))


def test_the_answer_reads_plainly() -> None:
    args = parse("gpu", "clear", "n3", "2")
    out = commands.formatted(args, {"node": "n3", "index": 2, "uuid": "GPU-c", "cleared": ["Xid 48 at t: x"],
                                    "kept": ["no new work: row remap pending"]})
    assert out == ("node n3 GPU 2 (GPU-c): cleared 1 Xid problem; NVML still reports: "
                   "no new work: row remap pending")
    assert gpu.render({"node": "n3", "index": 0, "uuid": "GPU-a"}) == "node n3 GPU 0 (GPU-a): no Xid problem to clear"


def test_the_server_finds_the_gpu_by_index_or_uuid() -> None:
    gpus = tuple(Gpu(i, f"GPU-{i}", "", 0, 0, "") for i in (0, 1, 2))
    assert find_gpu(gpus, "1") is gpus[1] and find_gpu(gpus, "GPU-2") is gpus[2]
    assert find_gpu(gpus, "7") is None and find_gpu(gpus, "GPU-9") is None
    assert is_xid("Xid 48 at t: x") and is_xid(soft("Xid 63 at t: x")) and not is_xid("lost: GPU is lost")


async def test_the_link_hands_clear_gpu_to_the_agent() -> None:
    got: list[tuple[str, ...]] = []

    async def on_desired(_: DesiredSet) -> None:
        return None

    hooks = LinkHooks(hello=lambda: Hello(1, None, None),  # type: ignore[arg-type]
                      on_desired=on_desired, on_clear_gpu=got.append)
    send, recv = trio.open_memory_channel[object](1)
    session = _Session(None, hooks, LinkSettings(1.0, 1.0, 1.0), recv)  # type: ignore[arg-type]
    await session.dispatch(ClearGpu(("GPU-a",)))
    assert got == [("GPU-a",)]
    send.close()
