"""The simulated engine's launch plan: vLLM's plan with `vllm` swapped for
`<python> -m llmgw.simengine`, which takes vLLM's command line (single node, mp, ray)."""

from __future__ import annotations

from attrs import evolve

from llmgw.agent.engines.plan import LaunchPlan
from llmgw.agent.engines.vllm import vllm_plan
from llmgw.config.agent import AgentConfig
from llmgw.errors import ConfigError
from llmgw.model.engine import EngineSpec

SIMENGINE_MODULE = "llmgw.simengine"


def simulated_plan(
    spec: EngineSpec,
    config: AgentConfig,
    python: str,
    env: dict[str, str],
    cwd: str,
    overrides: tuple[str, ...],
) -> LaunchPlan:
    interpreter = config.engines.simulated_python or python
    if not interpreter:
        raise ConfigError(
            config.source or "agent config",
            "engines.simulated_python",
            "empty, and no interpreter was given for the simulated engine",
        )
    engine = (interpreter, "-m", SIMENGINE_MODULE)
    # The simulated engine's gang is mp-shaped (rank 0 holds the rendezvous); it does not
    # run Ray, whatever this node's vLLM uses.
    mp = evolve(config.engines.vllm, launch_mode="mp")
    config = evolve(config, engines=evolve(config.engines, vllm=mp))
    return vllm_plan(engine, spec, config, env, cwd, overrides)
