"""Each engine's own API key, in its launch plan (no engine endpoint left open): pure, data in and out.

The agent makes the key (records.new_key) and keeps it in the engine's record; the plan
only says how the engine is given it, so that no plan (nor its log line) holds a secret:
`LaunchPlan.api_key_env` names the variable the spawn puts it in, `api_key_file` the
0600 file it writes it to. Never argv: /proc/<pid>/cmdline is readable by every user.

vLLM (0.32; and the simulated engine, which takes its command line): VLLM_API_KEY, read
by vLLM's own check (entrypoints/serve/middleware/register.py: `args.api_key or
[envs.VLLM_API_KEY]`), which guards only /v1, /v2, /inference and /cohere
(middleware/authenticate.py, GUARDED_PREFIX). Every other path (/metrics, /sleep,
/wake_up, /collective_rpc, /reset_prefix_cache, /server_info, /invocations, ...) is closed
by llmgw's own middleware, `--middleware llmgw_engine_guard.EngineKeyGuard` (vLLM's
frontend option, applied with app.add_middleware in the same register.py), importable
from GUARD_DIR, which the plan puts first on the engine's PYTHONPATH: all but GET /health.

SGLang (0.5.23) reads its key only from `--api-key` (arg_groups/fields/serving.py; no
variable), or from a YAML file named by `--config`, which its parser merges into its
argv in memory (utils/server_args_config_parser.py): the key goes in that file. Its
middleware (utils/auth.py, decide_request_auth) guards every path but OPTIONS and those
starting /health, /ready or /metrics.
"""

from __future__ import annotations

import posixpath

from attrs import evolve

from llmgw.agent.engines.plan import LaunchPlan
from llmgw.errors import EngineError
from llmgw.model.engine import EngineKind, EngineSpec

VLLM_KEY_ENV = "VLLM_API_KEY"
GUARD_MODULE = "llmgw_engine_guard"
GUARD_MIDDLEWARE = f"{GUARD_MODULE}.EngineKeyGuard"
# The folder holding only the guard module: on the engine's PYTHONPATH it shadows nothing.
GUARD_DIR = posixpath.join(posixpath.dirname(__file__), "guard")
SGLANG_KEY_FILE = "llmgw-engine-key.yaml"  # in the engine's folder (its cwd)


def guard_argv() -> tuple[str, ...]:
    return ("--middleware", GUARD_MIDDLEWARE)


def guard_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with GUARD_DIR first on PYTHONPATH (a deployment's own PYTHONPATH kept after it)."""
    own = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": GUARD_DIR + (":" + own if own else "")}


def sglang_key_file(cwd: str) -> str:
    return posixpath.join(cwd, SGLANG_KEY_FILE)


def sglang_key_config(key: str) -> str:
    """The YAML SGLang's --config reads. SGLang turns each key into `--<key> <value>` as
    written (ConfigArgumentMerger._add_scalar_arg): `api-key`, since `--api_key` is no
    flag of its parser (seen with sglang 0.5.23: "unrecognized arguments: --api_key").
    The value quoted, so that YAML never reads it as a number or a boolean; keys are
    url-safe base64 with a letter first (records.new_key): nothing to escape, and never
    taken for a flag when SGLang turns it back into argv."""
    return f'api-key: "{key}"\n'


def refuse_own_key(spec: EngineSpec) -> None:
    """A deployment's own --api-key would replace llmgw's key in vLLM (its flag wins over
    VLLM_API_KEY) and in SGLang (the command line wins over --config): the agent, the
    routers and every probe would then be refused. Said at start, not found as 401s."""
    own = ("--api-key", "--config") if spec.engine is EngineKind.SGLANG else ("--api-key",)
    for arg in spec.args:
        flag = arg.split("=", 1)[0]
        if flag in own:
            raise EngineError(
                f"replica {spec.replica_id}: the deployment's args set {flag}; llmgw gives "
                "every engine an API key of its own (in "
                + ("a --config file" if spec.engine is EngineKind.SGLANG else VLLM_KEY_ENV)
                + ") and sends it from the agent and the routers, so remove it from args")


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value a command line gives `flag` last (`--f v` or `--f=v`); None: not given."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def refuse_keyless_sglang(spec: EngineSpec) -> None:
    """SGLang 0.5.23 options that cannot run with an API key, refused at start with the
    reason rather than left to fail in the engine: several tokenizer workers (its
    init_multi_tokenizer asserts "API key is not supported in multi-tokenizer mode") and
    its native gRPC listener (arg_groups/serving_hook.py: "--grpc-port is incompatible
    with --api-key", the listener bypasses the HTTP middleware)."""
    workers = _flag_value(spec.args, "--tokenizer-worker-num")
    try:
        several = workers is not None and int(workers) > 1
    except ValueError:
        several = False  # SGLang's own parser says what is wrong with it
    why = ""
    if several:
        why = "--tokenizer-worker-num above 1 (SGLang takes no API key in multi-tokenizer mode)"
    elif _flag_value(spec.args, "--grpc-port") is not None:
        why = "--grpc-port (SGLang's gRPC listener takes no API key)"
    if why:
        raise EngineError(f"replica {spec.replica_id}: the deployment's args set {why}; llmgw "
                          "gives every engine an API key of its own, so remove it from args")


def with_key(plan: LaunchPlan, spec: EngineSpec) -> LaunchPlan:
    """`plan` with its engine set up to require the key the agent gives it at spawn: on
    the process that serves HTTP (single node, a gang's rank 0); members that serve none
    (headless vLLM, Ray workers, SGLang's other ranks and their always-200 health server)
    get nothing, and the agent sends them nothing."""
    if not plan.health_checked:
        return plan
    refuse_own_key(spec)
    main = plan.main
    if spec.engine is EngineKind.SGLANG:
        refuse_keyless_sglang(spec)
        path = sglang_key_file(main.cwd)
        main = evolve(main, argv=(*main.argv, "--config", path))
        return evolve(plan, processes=(*plan.processes[:-1], main), api_key_file=path)
    main = evolve(main, argv=(*main.argv, *guard_argv()), env=guard_env(main.env))
    return evolve(plan, processes=(*plan.processes[:-1], main), api_key_env=VLLM_KEY_ENV)
