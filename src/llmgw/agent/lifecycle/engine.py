"""One supervised engine as the supervisor's shell holds it: its record, its report, its
lifecycle (states.EngineLifecycle: the phase and the flags beside it) and the trio events
its tasks wait on."""

from __future__ import annotations

import trio
from attrs import define, field

from llmgw.agent.lifecycle.records import EngineRecord
from llmgw.agent.lifecycle.states import EngineLifecycle, Phase
from llmgw.agent.lora.sync import AdapterKeeper
from llmgw.model.engine import EngineReport, EngineSpec


@define(eq=False)
class Engine:
    record: EngineRecord
    health: bool  # False: liveness only (SGLang ranks > 0, headless and Ray members)
    report: EngineReport
    life: EngineLifecycle = field(factory=EngineLifecycle)
    # Set with life.stop_asked (the stopper task waits on it).
    stop_requested: trio.Event = field(factory=trio.Event)
    done: trio.Event = field(factory=trio.Event)
    settled: trio.Event = field(factory=trio.Event)  # left "starting" (or never will)
    # Processes seen in its session (the leader included): whose GPU memory must go.
    pids: set[int] = field(factory=set)
    # Loads and unloads its LoRA adapters while it runs; None: an engine that cannot.
    adapters: AdapterKeeper | None = None
    # Where its launcher writes the pre-flight's result (preflight_report); "": no probe.
    preflight_path: str = ""

    @property
    def spec(self) -> EngineSpec:
        return self.record.spec

    @property
    def state(self) -> Phase | None:
        return self.life.phase

    def ask_stop(self, reason: str) -> None:
        self.life.request_stop(reason)
        self.stop_requested.set()
