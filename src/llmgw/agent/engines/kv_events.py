"""KV-cache events in the launch plans: where the engine publishes them (Deployment.kv_events).

Both engines take `--kv-events-config JSON` and run a ZeroMQ PUB socket for the batches and
a ROUTER socket that replays its buffer from a given seq (vLLM 0.32
distributed/kv_events.py ZmqEventPublisher; SGLang 0.5.23 srt/disaggregation/kv_events.py,
a copy of it). llmgw points the PUB at tcp://127.0.0.1:KV_EVENTS_PUB, which the agent
binds: neither engine binds an endpoint without "*", "::" or an ipc/inproc scheme (SGLang
also "0.0.0.0", or its own "bind" key), so it connects. The ROUTER is always bound, here
on tcp://127.0.0.1:KV_EVENTS_REPLAY. Both ports are the engine block's
(model/deployment.py says why those two): no port leaves the node. The topic is the
replica id, for the log lines of whoever reads the stream.

Data parallelism would offset both ports by the rank (offset_endpoint_port in both
engines), into ports the block does not hold: a deployment asking for both is refused at
apply (config/vllm_serve.py kv_events_refusal), as is one whose args carry a
--kv-events-config of its own, which argparse would let win while the agent listened on
a port nobody publishes to.

Which process publishes: vLLM's scheduler, in the EngineCore (v1/core/sched/scheduler.py,
EventPublisherFactory.create). A headless rank of a multi-node mp gang runs only workers
(entrypoints/cli/serve.py run_headless, node_rank_within_dp > 0: a MultiprocExecutor), and
a Ray gang's other members run only Ray: the flag goes to rank 0 alone. SGLang's schedulers
publish where pp_rank, attn_tp_rank and attn_cp_rank are all 0 (is_kv_publisher_rank):
with llmgw's tensor parallelism across a gang's nodes, rank 0's node; rank 0 alone again.
"""

from __future__ import annotations

import json

from llmgw.errors import EngineError
from llmgw.model.deployment import KV_EVENTS_PUB, KV_EVENTS_REPLAY
from llmgw.model.engine import EngineSpec

FLAG = "--kv-events-config"
LOOPBACK = "127.0.0.1"


def publishes(spec: EngineSpec) -> bool:
    """Whether this member's engine is given the events config: asked for, and the
    gang's rank 0 (or one node)."""
    return spec.kv_events and (spec.gang is None or spec.gang.rank == 0)


def ports(spec: EngineSpec) -> tuple[int, int]:
    """(the port the agent binds for the PUB to connect to, the engine's replay port)."""
    if not spec.port_base:
        raise EngineError(f"replica {spec.replica_id}: kv_events needs the engine's port block "
                          "(a spec from a server that reserves none)")
    return spec.port_base + KV_EVENTS_PUB, spec.port_base + KV_EVENTS_REPLAY


def endpoints(spec: EngineSpec) -> tuple[str, str]:
    pub, replay = ports(spec)
    return f"tcp://{LOOPBACK}:{pub}", f"tcp://{LOOPBACK}:{replay}"


def vllm_config(spec: EngineSpec) -> str:
    """vLLM's KVEventsConfig (config/kv_events.py) as JSON: events on, the zmq publisher."""
    pub, replay = endpoints(spec)
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                       "replay_endpoint": replay, "topic": spec.replica_id})


def sglang_config(spec: EngineSpec) -> str:
    """SGLang's KVEventsConfig (a pydantic model, srt/disaggregation/kv_events.py) as JSON.
    It has no enable_kv_cache_events (the flag being set turns events on) and its
    publisher defaults to "null", so "zmq" is named; the rest is vLLM's shape."""
    pub, replay = endpoints(spec)
    return json.dumps({"publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
                       "topic": spec.replica_id})
