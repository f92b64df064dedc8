"""The agent: discovery, supervision and the link to the server, in one nursery.

Order matters: engines are adopted from their records before the first Hello, so the
server hears what already runs instead of starting it twice.
"""

from __future__ import annotations

import functools
import logging
import random
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio
import zmq
from attrs import evolve

from llmgw import PROTOCOL_VERSION
from llmgw.agent.discovery.discover import discover, inventory_changed
from llmgw.agent.discovery.gpus import load_nvml
from llmgw.agent.discovery.hca_watch import HcaHealth, serve_hca_watch, with_gone, without_hcas
from llmgw.agent.discovery.interfaces import interface_addresses, resolve_mgmt_interface
from llmgw.agent.discovery.nvml import GpuReads, read_gpu_memory
from llmgw.agent.gpus.claims import mark_inventory
from llmgw.agent.gpus.memory import GpuMemory, from_inventory
from llmgw.agent.gpus.usage import GpuSampler
from llmgw.agent.gpus.xid import XidProblems, serve_xid_watch
from llmgw.agent.kvevents.feeds import KvFeeds
from llmgw.agent.kvevents.relay import Relay
from llmgw.agent.kvevents.relay_serve import RelayService, keep_kv_relay
from llmgw.agent.kvevents.routers import AuthorizedRouters
from llmgw.agent.lifecycle.bad_copies import BadCopies
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.agent.link import Connection, LinkHooks, LinkSettings, serve_link
from llmgw.agent.metrics import AgentMetrics
from llmgw.config.agent import AgentConfig
from llmgw.errors import DiscoveryError
from llmgw.model.engine import EngineReport
from llmgw.model.inventory import GpuSource, Inventory, ModelCopy, NodeInfo
from llmgw.transport import dealer
from llmgw.transport.follow import Follower
from llmgw.transport.keys import load_pair, load_public
from llmgw.transport.messages import DesiredSet, EngineChanged, Hello, InventoryChanged, Message

log = logging.getLogger(__name__)

OUTBOX_SIZE = 1000


def engines_line(inventory: Inventory) -> str:
    """What the log says of the engine kinds this node can start."""
    able = [f"{e.kind} {e.version}".strip() for e in inventory.engines if e.available]
    unable = [f"{e.kind} ({e.key}: {e.reason})" for e in inventory.engines if not e.available]
    line = ", ".join(able) or "none"
    return line + (f"; cannot start {', '.join(unable)}" if unable else "")


def node_info(config: AgentConfig) -> NodeInfo:
    return NodeInfo(
        node_id=config.node_id,
        mgmt_addr=config.mgmt_addr,
        mgmt_interface=config.mgmt_interface,
        labels=dict(config.labels),
        port_range=config.port_range,
        kv_relay=kv_relay_endpoint(config),
    )


def kv_relay_endpoint(config: AgentConfig) -> str:
    """Where routers reach this node's KV-event relay (the server passes it on in the
    endpoint table): tcp://mgmt_addr:kv_relay_port; "" where kv_relay_port is 0."""
    if not config.kv_relay_port:
        return ""
    host = config.mgmt_addr
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address: the port follows the brackets
    return f"tcp://{host}:{config.kv_relay_port}"


def with_mgmt_interface(config: AgentConfig) -> AgentConfig:
    """`config` with the interface that holds mgmt_addr: engines pin NCCL's and Gloo's
    bootstrap to it (unset, Gloo binds the hostname's address, often 127.0.1.1). Left
    empty, it is found; configured, it must exist and hold mgmt_addr. Raises ConfigError
    (exit 2), as a missing HCA does: a node whose engines cannot bootstrap must not join."""
    name = resolve_mgmt_interface(config.mgmt_interface, config.mgmt_addr, interface_addresses(),
                                  source=config.source or "agent configuration")
    if name != config.mgmt_interface:
        log.info("mgmt_interface: %s (it holds mgmt_addr %s)", name, config.mgmt_addr)
    return evolve(config, mgmt_interface=name)


class Agent:
    def __init__(self, config: AgentConfig, *, python: str = sys.executable, nvml: object | None = None):
        config = with_mgmt_interface(config)
        self.config = config
        self.python = python
        self.nvml = nvml
        self.inventory = Inventory()
        self._logged: set[str] = set()
        self._send, self._outbox = trio.open_memory_channel[Message](OUTBOX_SIZE)
        self._rediscover = trio.Event()
        disc = config.discovery
        # NVML for the per-GPU metrics, the Xid watch and the check before each spawn, only
        # where discovery would use it too.
        self._nvml = None if disc.skip_gpus or not disc.prefer_nvml else (nvml or load_nvml())
        # Xid critical errors: such a GPU needs a reset, so the problem stays until NVML's
        # readings show one (XidProblems.observe) or the operator clears it (ctl gpu clear).
        self.xid = XidProblems()
        # What one NVML read of the GPUs hands the next: a read error is a problem only
        # after several in a row; the latest health readings, for the Xids' reset watch.
        self.gpu_reads = GpuReads()
        # The labelled HCAs' ports, read every few seconds: a port down or erring is a
        # problem on its HCA in every inventory (the server moves what rides it).
        self.hca_health = HcaHealth(quiet=disc.hca_quiet)
        # Copies of weights an engine died reading: shown incomplete, never used again,
        # until a scan finds them changed.
        self.bad_copies = BadCopies()
        # The router keys the server authorizes (its RouterKeys messages): the routers the
        # KV-event relay lets in.
        self.routers = AuthorizedRouters()
        # The relay of the engines' KV-cache events to those routers (kv_relay_port), fed
        # by a receiver per engine that publishes them. Lives are drawn from the OS's
        # randomness: a restarted agent never takes up a life a router still holds.
        self.kv_relay = RelayService(Relay(random.SystemRandom()))
        self.kv_feeds = KvFeeds(self.kv_relay) if config.kv_relay_port else None
        # An engine whose command does not resolve: look again, so the inventory says so.
        # An engine started or gone, or a GPU released: look again, so that the server sees
        # the memory and the releasing GPUs as they are now.
        self.supervisor = Supervisor(config, self._on_report, python=python,
                                     on_unavailable=lambda: self._rediscover.set(),
                                     gpu_memory=self._read_gpus, model_size=self._model_size,
                                     on_gpus_changed=lambda: self._rediscover.set(),
                                     storage=lambda: self.inventory.storage,
                                     inventory=lambda: self.inventory,
                                     on_bad_copy=self._on_bad_copy, kv=self.kv_feeds)
        self._engines_stopped = False
        sampler = GpuSampler(self._nvml)
        self.metrics = AgentMetrics(
            config.node_id, self.supervisor.reports,
            lambda: (self.supervisor.starts_total, self.supervisor.restarts_total),
            lambda: self.inventory, sampler)
        self.supervisor.on_probe = self.metrics.probed

    def _read_gpus(self) -> Mapping[str, GpuMemory] | None:
        """What the supervisor checks before a spawn (blocking: it runs this in a thread).
        NVML's answer now where NVML found the GPUs; otherwise (nvidia-smi, simulated GPUs)
        the last inventory's, which is the best this node can tell."""
        if self.inventory.gpu_source is GpuSource.NVML and self._nvml is not None:
            read = read_gpu_memory(self._nvml, reads=self.gpu_reads)
            return None if read is None else self.xid.apply_memory(read)
        return from_inventory(self.inventory)

    def _model_size(self, model: str) -> int:
        """Bytes of a complete copy of `model` this node sees (0: none or unknown), for the
        startup deadline's floor."""
        for m in self.inventory.storage.models:
            if m.complete and (m.name == model or m.path == model):
                return m.size
        return 0

    def _on_bad_copy(self, copy: ModelCopy, why: str) -> None:
        if not self.bad_copies.add(copy, why):
            return
        # At once, not at the next scan: the server may restart the replica here within
        # seconds, and its plan reads this inventory's storage.
        self.inventory = evolve(self.inventory, storage=self.bad_copies.apply(self.inventory.storage))
        self._post(InventoryChanged(self.inventory))

    def _on_xid(self, uuid: str, problem: str) -> bool:
        if not self.xid.add(uuid, problem):
            return False
        log.error("GPU %s: %s; no engine is placed on it until it is reset (or `llmgw ctl gpu "
                  "clear %s %s`)", uuid, problem, self.config.node_id, uuid)
        self._rediscover.set()
        return True

    def _on_unresolved_xid(self, xid: int) -> None:
        # Which GPU is not known: read them all now, rather than at the next interval.
        self._rediscover.set()

    def clear_gpus(self, gpus: tuple[str, ...]) -> None:
        """The operator's `ctl gpu clear`: forget these GPUs' Xid problems (by UUID) and
        report at once. What NVML itself reads (a pending remap, a recovery action) stays:
        it is read again each time."""
        for uuid in gpus:
            gone = self.xid.clear(uuid)
            log.warning("GPU %s: Xid problems cleared by the operator (%s)", uuid,
                        "; ".join(gone) or "there were none")
        self._rediscover.set()

    def _post(self, msg: Message) -> None:
        # While disconnected nothing is lost by dropping: the next Hello carries it all.
        try:
            self._send.send_nowait(msg)
        except trio.WouldBlock:
            log.warning("outbox full; dropped a %s (the next Hello resends the state)",
                        type(msg).__name__)

    def _on_report(self, report: EngineReport) -> None:
        self._post(EngineChanged(report))

    def hello(self) -> Hello:
        return Hello(PROTOCOL_VERSION, node_info(self.config), self.inventory,
                     self.supervisor.reports())

    async def _on_desired(self, desired: DesiredSet) -> None:
        if self._engines_stopped:
            log.debug("engines stopped with the agent: ignored desired set %d", desired.generation)
            return
        await self.supervisor.apply(desired.engines)

    async def stop_engines(self) -> None:
        """Stop every engine and ignore the server's desired sets from now on.

        Not what a node agent does (its engines outlive it); `llmgw dev`, whose engines
        must end with it, does."""
        self._engines_stopped = True
        await self.supervisor.apply(())

    def _on_connected(self) -> None:
        # Anything queued while disconnected is older than the Hello just sent.
        while True:
            try:
                self._outbox.receive_nowait()
            except trio.WouldBlock:
                return

    async def _discovery_loop(self) -> None:
        while True:
            with trio.move_on_after(self.config.discovery.interval):
                await self._rediscover.wait()
            self._rediscover = trio.Event()
            try:
                new = await self._discover()
            except Exception:
                self.metrics.discovery_failures += 1
                log.exception("discovery failed; keeping the last inventory")
                continue
            if inventory_changed(self.inventory, new):
                if new.engines != self.inventory.engines:
                    log.info("engines: %s", engines_line(new))
                self.inventory = new
                self._post(InventoryChanged(new))

    async def _discover(self) -> Inventory:
        """Discovery, with what only this agent knows: its own engines are not foreign
        holders of GPU memory, the GPUs its stopped engines have not released yet, and the
        Xid errors seen since it started."""
        with self.metrics.discovery.time():
            try:
                found = await discover(self.config, nvml=self.nvml, logged=self._logged,
                                       python=self.python, gpu_reads=self.gpu_reads)
            except DiscoveryError:
                # At start nothing is gone yet: a missing HCA is a wrong label (exit 2).
                gone = self.hca_health.gone()
                if not gone:
                    raise
                found = with_gone(await discover(without_hcas(self.config, gone), nvml=self.nvml,
                                                 logged=self._logged, python=self.python,
                                                 gpu_reads=self.gpu_reads),
                                  self.config, gone)
        own = await trio.to_thread.run_sync(self.supervisor.engine_pids)
        for uuid in self.xid.observe(self.gpu_reads.health()):
            log.warning("GPU %s: reset since its Xid (NVML's readings say so): placed again", uuid)
        found = self.hca_health.apply(found)
        found = evolve(found, storage=self.bad_copies.apply(found.storage))
        return mark_inventory(self.xid.apply(found), own, self.supervisor.releasing())

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # A configuration that contradicts the node (a missing HCA) stops us here.
        self.inventory = await self._discover()
        log.info(
            "node %s: %d GPUs (%s), fabrics: %s, storage: %s, engines: %s",
            self.config.node_id, len(self.inventory.gpus), self.inventory.gpu_source,
            ", ".join(f"{f.name}={f.state}" for f in self.inventory.fabrics) or "none (island)",
            f"{len(self.inventory.storage.models)} models" if self.inventory.storage.asked
            else "not asked",
            engines_line(self.inventory),
        )
        pair = load_pair(self.config.keys.secret_key)
        server_public = load_public(self.config.keys.server_key)
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            async with trio.open_nursery() as nursery:
                if self.config.metrics_bind:
                    await nursery.start(self.metrics.serve, self.config.metrics_bind)
                if self.kv_feeds is not None:
                    # Before the supervisor: adopted engines' receivers start in its serve.
                    self.kv_feeds.ctx = ctx
                    await nursery.start(keep_kv_relay, ctx, self.kv_relay,
                                        kv_relay_endpoint(self.config), pair, self.routers)
                await nursery.start(self.supervisor.serve)
                # The engines adopted just now are this agent's, not foreign holders.
                own = await trio.to_thread.run_sync(self.supervisor.engine_pids)
                self.inventory = mark_inventory(self.inventory, own, self.supervisor.releasing())
                await nursery.start(functools.partial(
                    serve_xid_watch, self._nvml, self._on_xid, on_unresolved=self._on_unresolved_xid))
                labelled = tuple(dict.fromkeys(h for f in self.config.fabrics for h in f.hcas))
                await nursery.start(serve_hca_watch, self.config.discovery.ib_root, labelled,
                                    self.hca_health, lambda: self._rediscover.set(),
                                    self.config.discovery.hca_interval)

                servers = Follower(self.config.server)

                @asynccontextmanager
                async def connect() -> AsyncIterator[Connection]:
                    async with dealer.connect(ctx, servers.pick(), pair, server_public,
                                              server_key_file=self.config.keys.server_key) as c:
                        yield c

                def connected() -> None:
                    servers.connected()
                    self._on_connected()

                hooks = LinkHooks(
                    hello=self.hello,
                    on_desired=self._on_desired,
                    on_rediscover=lambda: self._rediscover.set(),
                    on_clear_gpu=self.clear_gpus,
                    logs=self.supervisor.log_tail,
                    on_connected=connected,
                    on_not_leader=servers.redirected,
                    on_router_keys=self.routers.update,
                )
                settings = LinkSettings(self.config.heartbeat_interval, self.config.reconnect_base,
                                        self.config.reconnect_max)
                nursery.start_soon(self._discovery_loop)
                await nursery.start(serve_link, settings, connect, hooks, self._outbox)
                task_status.started()
        finally:
            ctx.destroy(linger=0)
            self.metrics.sampler.close()
