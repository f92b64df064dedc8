from __future__ import annotations

import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.errors import ProtocolError
from llmgw.model.apikey import Budget
from llmgw.model.deployment import Deployment
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
from llmgw.model.usage import UsageRow
from llmgw.transport import codec, messages, requests
from llmgw.transport.apikey_ops import (
    ApiKeyCreateOp,
    ApiKeyImportOp,
    ApiKeyListOp,
    ApiKeyRevokeOp,
    ApiKeyUpdateOp,
    Held,
    KeyTableOp,
    LeaseOp,
    LimitKind,
    Unused,
    UsageOp,
    UsageReportOp,
)
from llmgw.transport.gpu_ops import GpuClearOp

INV = Inventory(
    gpus=(Gpu(0, "GPU-a", "H100", 81559, 80000, "00000000:18:00.0", 0, "9.0", {"GPU-b": 18}),),
    gpu_source=GpuSource.NVML,
    fabrics=(FabricReport("ib-a", ("mlx5_0",), FabricState.DEGRADED, 200.0),),
    storage=StorageReport(True, (ModelCopy("org/m", "/m", 10, False, "no config.json"),)),
)
SPEC = EngineSpec("d-0", 3, "d", "org/m", "m", EngineKind.VLLM, ("GPU-a",), 20001,
                  gang=GangSpec(2, 1, "10.0.0.1", 20002, ("mlx5_0",)), env={"A": "1"})

DEPLOYMENT = Deployment("d", "org/m", EngineKind.VLLM, 8, 2, args=("--x", "1"), env={"A": "1"})
OPS: list[requests.Op] = [
    requests.StatusOp(), requests.ApplyOp(DEPLOYMENT, "d.yaml"), requests.DeleteOp("d"),
    requests.ScaleOp("d", 3), requests.CordonOp("n", True, True), requests.GetOp(requests.GetWhat.NODES),
    requests.DescribeOp("d"), requests.EndpointsOp(4), requests.LogsOp("d-0", 50),
    requests.RediscoverOp(("n",)),
    GpuClearOp("n", "2"), GpuClearOp("n", "GPU-a"),
    requests.LoadReportOp({"m": requests.ModelLoad(1.5, 2, 3, 1)}, interval=0.5, wake=True),
    requests.ScaleOp("d", 0, pin=True),
    # API keys (issue 24)
    ApiKeyCreateOp("a", "0" * 64, "llmgw-abc", ("m",), 10, 20, 4, Budget(100, 3600.0), 2e9),
    ApiKeyUpdateOp("a", rpm=3, clear_budget=True), ApiKeyRevokeOp("a"), ApiKeyListOp("a"),
    ApiKeyImportOp((ApiKeyCreateOp("b", "1" * 64),)), KeyTableOp("abc"),
    UsageReportOp("batch-0001", (UsageRow("k", "m", 3600, 200, 2, 6, 3, 1.5),)),
    UsageOp("k", "m", 3600.0),
    LeaseOp("k", LimitKind.TPM, 50, (Unused("k", LimitKind.RPM, 3, 1),)),
    LeaseOp("k", LimitKind.CONCURRENCY, 1, (), "ab", (Held("k", LimitKind.CONCURRENCY, "ab", 2, 1, 9.5),)),
]

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
    messages.ClearGpu(("GPU-a",)),
    messages.RouterKeys(("K" * 40, "L" * 40)),
    messages.LogsRequest("q", "d-0", 50),
    messages.NotLeader("tcp://10.0.0.2:7443", "r1"),
    *(messages.Request(1, "q", op) for op in OPS),
    messages.Reply("q", True, {"nodes": []}),
]


def test_every_kind_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(typing.get_args(messages.Message))
    assert {type(op) for op in OPS} == set(typing.get_args(requests.Op))


@pytest.mark.parametrize(
    ("op", "match"),
    [
        ({"op": "get", "what": "pods"}, "pods"),
        ({"op": "scale", "name": "d", "replicas": "3"}, "expected int"),
        ({"op": "cordon", "node": "n", "cordoned": "false"}, "expected bool"),
        ({"op": "launch"}, "launch"),
        ({"op": ["status"]}, "request"),
        ({"op": "apply", "deployment": {"name": "d", "model": "m", "engine": "vllm",
                                        "gpus_per_node": 0, "replicas": 1}}, "gpus_per_node"),
        ({"op": "apply", "deployment": {"name": "Bad Name"}}, "the request: model: missing"),
    ],
)
def test_bad_requests_are_protocol_errors(op: dict[str, object], match: str) -> None:
    data = msgpack.packb({"kind": "request", "protocol": 1, "request_id": "q", "op": op})
    with pytest.raises(ProtocolError, match=match):
        codec.decode(data)


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
        (msgpack.packb({"seq": 1}), "unknown message kind: a NoneType"),
        (msgpack.packb({"kind": "heartbeat", "seq": "one"}), "bad heartbeat"),
        (msgpack.packb({"kind": "heartbeat", "seq": 1, "extra": 1}), "(?i)extra fields"),
        (msgpack.packb({"kind": "refused"}), "bad refused"),
    ],
)
def test_bad_bytes_are_protocol_errors(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        codec.decode(data)


@given(st.integers(-(2**63), 2**64 - 1))
def test_heartbeat_paths_match_the_converter(seq: int) -> None:
    """Heartbeat and HeartbeatAck take a short path: the same bytes and values as the
    converter's, the same refusals."""
    ack = messages.HeartbeatAck(seq)
    assert codec.encode(ack) == msgpack.packb(codec.converter.unstructure(ack, messages.Message))
    beat = msgpack.packb(codec.converter.unstructure(messages.Heartbeat(seq), messages.Message))
    assert codec.decode(beat) == messages.Heartbeat(seq)
    assert type(codec.decode(beat)) is messages.Heartbeat


@pytest.mark.parametrize("raw", [
    {"kind": "heartbeat", "seq": True},
    {"kind": "heartbeat", "seq": 1.0},
    {"kind": "heartbeat"},
    {"kind": "heartbeat", "seq": 1, "x": None},
])
def test_heartbeat_short_path_refuses_what_the_converter_refuses(raw: dict[str, object]) -> None:
    with pytest.raises(ProtocolError, match="bad heartbeat"):
        codec.decode(msgpack.packb(raw))


# ---- decode is total: whatever bytes, a Message or a ProtocolError ----

_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _decodes_or_protocol_error(data: bytes) -> None:
    try:
        codec.decode(data)
    except ProtocolError as exc:
        assert len(str(exc)) < 2000  # error text ends up in log lines: bounded
    # Anything else propagates and fails the test.


@pytest.mark.parametrize(
    "kind", [[], {}, [1, 2], {"a": 1}, 1, None, b"hello", 1.5, True, "x" * 100_000],
    ids=lambda k: type(k).__name__,
)
def test_unhashable_or_odd_kinds_are_protocol_errors(kind: object) -> None:
    with pytest.raises(ProtocolError, match="unknown message kind"):
        codec.decode(msgpack.packb({"kind": kind}))
    with pytest.raises(ProtocolError, match="bad request message"):
        codec.decode(msgpack.packb({"kind": "request", "protocol": 1, "request_id": "q", "op": {"op": kind}}))


def test_deeply_nested_kind_is_a_protocol_error() -> None:
    # As deep as msgpack allows: repr() of it would exceed Python's recursion limit.
    depth = 1000
    data = b"\x81\xa4kind" + b"\x91" * depth + b"\xc0"
    with pytest.raises(ProtocolError, match="a list, not a name"):
        codec.decode(data)


def test_deep_nesting_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        codec.decode(b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(ProtocolError):
        codec.decode(b"\x81\xa4kind\xa5hello" + b"\x81\xa1a" * 50_000 + b"\xc0")


@given(st.binary(max_size=512))
@settings(max_examples=2000, deadline=None, database=None)
def test_random_bytes(data: bytes) -> None:
    _decodes_or_protocol_error(data)


@given(st.sampled_from(SAMPLES), st.data())
@settings(max_examples=2000, deadline=None, database=None)
def test_mutated_bytes(msg: messages.Message, data: st.DataObject) -> None:
    raw = bytearray(codec.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        i = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[i] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and raw:
            del raw[i]
        else:
            del raw[i:]
    _decodes_or_protocol_error(bytes(raw))


@given(st.sampled_from(SAMPLES), st.data())
@settings(max_examples=2000, deadline=None, database=None)
def test_mutated_structure(msg: messages.Message, data: st.DataObject) -> None:
    """Valid maps with one value replaced, a key dropped or one added, at any depth."""
    tree = msgpack.unpackb(codec.encode(msg))

    def mutate(node: object) -> object:
        if isinstance(node, dict) and node and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(node, key=repr)))
            op = data.draw(st.sampled_from(["replace", "drop", "add", "descend"]))
            if op == "replace":
                node[key] = data.draw(_values)
            elif op == "drop":
                del node[key]
            elif op == "add":
                node[data.draw(st.text(max_size=8))] = data.draw(_values)
            else:
                node[key] = mutate(node[key])
            return node
        if isinstance(node, list) and node:
            i = data.draw(st.integers(0, len(node) - 1))
            node[i] = mutate(node[i]) if data.draw(st.booleans()) else data.draw(_values)
            return node
        return data.draw(_values)

    _decodes_or_protocol_error(msgpack.packb(mutate(tree), use_bin_type=True))
