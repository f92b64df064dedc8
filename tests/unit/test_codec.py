from __future__ import annotations

import typing

import msgpack
import pytest

from llmgw.errors import ProtocolError
from llmgw.model.engine import EngineKind, EngineReport, EngineSpec, EngineState, GangSpec
from llmgw.model.inventory import (
    FabricReport,
    FabricState,
    Gpu,
    GpuSource,
    Inventory,
    ModelCopy,
    NodeInfo,
    StorageReport,
)
from llmgw.transport import codec, messages

INV = Inventory(
    gpus=(Gpu(0, "GPU-a", "H100", 81559, 80000, "00000000:18:00.0", 0, "9.0", {"GPU-b": 18}),),
    gpu_source=GpuSource.NVML,
    fabrics=(FabricReport("ib-a", ("mlx5_0",), FabricState.DEGRADED, 200.0),),
    storage=StorageReport(True, (ModelCopy("org/m", "/m", 10, False, "no config.json"),)),
)
SPEC = EngineSpec("d-0", 3, "d", "org/m", "m", EngineKind.VLLM, ("GPU-a",), 20001,
                  gang=GangSpec(2, 1, "10.0.0.1", 20002, ("mlx5_0",)), env={"A": "1"})

SAMPLES: list[messages.Message] = [
    messages.Hello(1, NodeInfo("n", "10.0.0.2", "eth0", {"rack": "r1"}, (100, 200)), INV,
                   (EngineReport("d-0", 3, EngineState.READY, "http://x:1", 5),)),
    messages.Heartbeat(7),
    messages.InventoryChanged(INV),
    messages.EngineChanged(EngineReport("d-0", 3, EngineState.EXITED, exit_code=1,
                                        log_tail=("boom",))),
    messages.LogsReply("q", "d-0", ("a", "b")),
    messages.Welcome(1, "n", 5.0),
    messages.Refused("no"),
    messages.HelloFirst("who?"),
    messages.HeartbeatAck(7),
    messages.DesiredSet(4, (SPEC,)),
    messages.Rediscover(),
    messages.LogsRequest("q", "d-0", 50),
    messages.Request(1, "q", "status", {"x": [1, 2]}),
    messages.Reply("q", True, {"nodes": []}),
]


def test_every_kind_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(typing.get_args(messages.Message))


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: messages.Message) -> None:
    assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xc1garbage", "not msgpack"),
        (codec.encode(messages.Heartbeat(1))[:-1], "not msgpack"),
        (msgpack.packb([1, 2]), "expected a map"),
        (msgpack.packb({"kind": "launch_missiles"}), "unknown message kind"),
        (msgpack.packb({"seq": 1}), "unknown message kind None"),
        (msgpack.packb({"kind": "heartbeat", "seq": "one"}), "bad heartbeat"),
        (msgpack.packb({"kind": "heartbeat", "seq": 1, "extra": 1}), "extra fields"),
        (msgpack.packb({"kind": "refused"}), "bad refused"),
    ],
)
def test_bad_bytes_are_protocol_errors(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        codec.decode(data)
