"""Command line and environment of the simulated engine.

The simulated engine accepts the argument shapes llmgw emits for the real engines, so
that end-to-end tests run the real launch plans with only the binary swapped:

- vLLM:   ``serve MODEL --host H --port P --served-model-name N --tensor-parallel-size T
  [--pipeline-parallel-size N --nnodes N --node-rank R --master-addr A --master-port MP
  --headless --distributed-executor-backend ray ...]``
- SGLang: ``--model-path M --served-model-name N --host H --port P --tp-size T
  [--nnodes N --node-rank R --dist-init-addr A:P]``

Flags it does not know are kept in ``SimArgs.unknown`` (and logged), never an error.
The simulation knobs come from flags or, so that launch plans need not change, from
``LLMGW_SIM_*`` environment variables (a flag wins over the environment).

Pure but for one read: argv and an environment mapping in, a frozen SimArgs out (SGLang's
--config file, where it names one, is read for its api_key).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

import yaml
from attrs import field, frozen

from llmgw.errors import UsageError
from llmgw.simengine.auth import GUARD_MIDDLEWARE, KeyCheck

# vLLM's parallel config default for --master-port.
VLLM_DEFAULT_MASTER_PORT = 29501


@frozen
class SimArgs:
    shape: str  # "vllm" or "sglang": which command line it was given
    model: str
    served_names: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rendezvous_host: str = ""  # vLLM --master-addr / SGLang --dist-init-addr host
    rendezvous_port: int = 0  # vLLM --master-port / SGLang --dist-init-addr port
    headless: bool = False
    executor_backend: str = ""
    # Simulation knobs.
    load_seconds: float = 0.0
    tokens_per_second: float = 50.0
    ttft: float = 0.05
    tokens: int = 16
    exit_after: float | None = None
    ignore_sigterm: bool = False
    max_running: int = 256
    # An engine that crashes mid-answer: the process exits at once after sending this many
    # tokens of one stream (0: never). Mid-stream failover is tested with it.
    die_after_tokens: int = 0
    # vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: stay up (health 503) when the gang breaks.
    keep_alive_on_death: bool = False
    # LoRA as vLLM takes it: --enable-lora --max-loras --max-lora-rank, --lora-modules
    # NAME=PATH at start, and the load/unload endpoints only with
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING ("1" or "true", any case, as vLLM's envs.py reads it).
    lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    runtime_lora: bool = False
    # vLLM's sleep mode: --enable-sleep-mode, and /sleep, /wake_up, /is_sleeping served only
    # with VLLM_SERVER_DEV_MODE (read as vLLM 0.32's envs.py does: bool(int(value))).
    sleep_mode: bool = False
    dev_mode: bool = False
    unknown: tuple[str, ...] = ()
    # Its API key(s) and who checks them (auth.py): --api-key, VLLM_API_KEY, llmgw's
    # guard named by --middleware, SGLang's --config file.
    keys: KeyCheck = field(factory=KeyCheck, repr=False)

    @property
    def served_name(self) -> str:
        return self.served_names[0]

    @property
    def is_gang(self) -> bool:
        return self.nnodes > 1

    @property
    def serves_api(self) -> bool:
        """Rank 0 serves the OpenAI API; other ranks do not (vLLM --headless)."""
        return self.node_rank == 0 and not self.headless


def _float(value: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UsageError(f"simengine: {name} must be a number, got {value!r}") from None


def _knob(flag: str | float | None, env: Mapping[str, str], key: str, default: float) -> float:
    if flag is not None:
        return float(flag)
    raw = env.get(key, "").strip()
    return _float(raw, key) if raw else default


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"simengine: {message}")


def _parser() -> _Parser:
    p = _Parser(prog="python -m llmgw.simengine", add_help=False, allow_abbrev=False)
    # vLLM shape
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="")
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--distributed-executor-backend", default="")
    p.add_argument("--model", dest="model_flag", default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=None)  # vLLM's CPU cache: no effect here
    p.add_argument("--lora-modules", nargs="+", default=())
    p.add_argument("--enable-sleep-mode", action="store_true")
    # vLLM: --api-key K [K ...] (its frontend's list), --middleware IMPORT.PATH (append);
    # SGLang: --api-key K and --config FILE.yaml.
    p.add_argument("--api-key", nargs="+", default=None)
    p.add_argument("--middleware", action="append", default=[])
    p.add_argument("--config", default=None)
    # SGLang shape
    p.add_argument("--model-path", default=None)
    p.add_argument("--tp", "--tp-size", dest="tp", type=int, default=None)
    p.add_argument("--dist-init-addr", default="")
    # Simulation knobs (flags; the LLMGW_SIM_* environment is the other way in)
    p.add_argument("--sim-load-seconds", default=None)
    p.add_argument("--sim-tokens-per-second", default=None)
    p.add_argument("--sim-ttft", default=None)
    p.add_argument("--sim-tokens", default=None)
    p.add_argument("--sim-exit-after", default=None)
    p.add_argument("--sim-ignore-sigterm", action="store_true")
    p.add_argument("--sim-max-running", default=None)
    p.add_argument("--sim-die-after-tokens", default=None)
    return p


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"simengine: --dist-init-addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def _lora_module(item: str) -> tuple[str, str]:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise UsageError(f"simengine: --lora-modules takes NAME=PATH, got {item!r}")
    return name, path


def parse_args(argv: Sequence[str], env: Mapping[str, str]) -> SimArgs:
    """Parse a vLLM- or SGLang-shaped command line plus LLMGW_SIM_* variables."""
    args = list(argv)
    shape = "sglang"
    model: str | None = None
    if args and args[0] == "serve":
        shape = "vllm"
        args = args[1:]
        if args and not args[0].startswith("-"):
            model = args[0]
            args = args[1:]
    ns, unknown = _parser().parse_known_args(args)
    if ns.model_flag:
        model = model or ns.model_flag
    if ns.model_path:
        model = model or ns.model_path
    if not model:
        raise UsageError("simengine: no model given (vllm: serve MODEL; sglang: --model-path)")
    if shape != "vllm" and not ns.model_path:
        shape = "vllm"  # e.g. `--model M` without `serve`

    tp = ns.tensor_parallel_size or ns.tp or 1
    rdv_host, rdv_port = "", 0
    if ns.dist_init_addr:
        rdv_host, rdv_port = _split_addr(ns.dist_init_addr)
    elif ns.nnodes > 1:
        rdv_host = ns.master_addr or "127.0.0.1"
        rdv_port = ns.master_port or VLLM_DEFAULT_MASTER_PORT
    if ns.max_cpu_loras is not None and ns.max_cpu_loras < ns.max_loras:
        # As vLLM's LoRAConfig refuses it (config/lora.py).
        raise UsageError(f"simengine: max_cpu_loras ({ns.max_cpu_loras}) must be >= "
                         f"max_loras ({ns.max_loras}).")
    keys = _keys(shape, ns, env)
    if ns.nnodes < 1 or not 0 <= ns.node_rank < ns.nnodes:
        raise UsageError(f"simengine: node rank {ns.node_rank} is outside nnodes {ns.nnodes}")

    exit_after_raw = ns.sim_exit_after
    if exit_after_raw is None:
        exit_after_raw = env.get("LLMGW_SIM_EXIT_AFTER", "").strip() or None
    ignore = ns.sim_ignore_sigterm or env.get("LLMGW_SIM_IGNORE_SIGTERM", "") in ("1", "true")
    return SimArgs(
        shape=shape,
        model=model,
        served_names=tuple(ns.served_model_name or (model,)),
        host=ns.host,
        port=ns.port if ns.port is not None else (30000 if shape == "sglang" else 8000),
        tensor_parallel=tp,
        pipeline_parallel=ns.pipeline_parallel_size,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        rendezvous_host=rdv_host,
        rendezvous_port=rdv_port,
        headless=ns.headless,
        executor_backend=ns.distributed_executor_backend,
        load_seconds=_knob(ns.sim_load_seconds, env, "LLMGW_SIM_LOAD_SECONDS", 0.0),
        tokens_per_second=_knob(ns.sim_tokens_per_second, env, "LLMGW_SIM_TOKENS_PER_SECOND", 50.0),
        ttft=_knob(ns.sim_ttft, env, "LLMGW_SIM_TTFT", 0.05),
        tokens=int(_knob(ns.sim_tokens, env, "LLMGW_SIM_TOKENS", 16)),
        exit_after=(
            _float(str(exit_after_raw), "LLMGW_SIM_EXIT_AFTER") if exit_after_raw else None
        ),
        ignore_sigterm=ignore,
        max_running=int(_knob(ns.sim_max_running, env, "LLMGW_SIM_MAX_RUNNING", 256)),
        die_after_tokens=int(_knob(ns.sim_die_after_tokens, env, "LLMGW_SIM_DIE_AFTER_TOKENS", 0)),
        keep_alive_on_death=env.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "") in ("1", "true"),
        lora=ns.enable_lora,
        max_loras=ns.max_loras,
        max_lora_rank=ns.max_lora_rank,
        lora_modules=tuple(_lora_module(m) for m in ns.lora_modules),
        runtime_lora=env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"),
        sleep_mode=ns.enable_sleep_mode,
        dev_mode=_dev_mode(env.get("VLLM_SERVER_DEV_MODE", "0")),
        unknown=tuple(unknown),
        keys=keys,
    )


def _keys(shape: str, ns: argparse.Namespace, env: Mapping[str, str]) -> KeyCheck:
    if shape == "sglang":
        key = ns.api_key[-1] if ns.api_key else ""
        if ns.config and not key:
            key = _config_key(ns.config)
        return KeyCheck("sglang", sglang_key=key)
    own = tuple(k for k in (ns.api_key or [env.get("VLLM_API_KEY", "")]) if k)
    guard = ""
    if GUARD_MIDDLEWARE in ns.middleware:
        guard = env.get("VLLM_API_KEY", "")
        if not guard:  # as the guard itself refuses to start
            raise UsageError("simengine: --middleware names llmgw's guard, and VLLM_API_KEY is not set")
    return KeyCheck("vllm", vllm_keys=own, guard_key=guard)


def _config_key(path: str) -> str:
    """SGLang's --config: a YAML map whose `api-key` is the key (its other keys: flags
    this copy reads from argv only, ignored). SGLang makes `--<key>` of each key as
    written, so `api_key` is refused there, and here."""
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"simengine: cannot read --config {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"simengine: --config {path}: not a map")
    if "api_key" in doc:
        raise UsageError("simengine: unrecognized arguments: --api_key (SGLang's --config)")
    key = doc.get("api-key")
    return str(key) if key is not None else ""


def _dev_mode(raw: str) -> bool:
    try:
        return bool(int(raw or "0"))
    except ValueError:  # vLLM dies on it at start: so does its copy
        raise UsageError(f"simengine: VLLM_SERVER_DEV_MODE must be an integer, got {raw!r}") from None
