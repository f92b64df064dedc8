"""What `vllm serve` will make of a deployment's args, where llmgw must know before it
starts one: how many API server processes vLLM runs, and whether that refuses runtime
LoRA. Pure: args and env in, a count or a reason out.

vLLM 0.32 (entrypoints/cli/serve.py, ServeSubcommand.cmd) runs `--api-server-count`
API processes; unset, it defaults to 0 with `--headless`, 1 with the multi-port or an
external load balancer (`--data-parallel-multi-port-external-lb`,
`--data-parallel-external-lb`, `--data-parallel-rank`), `--data-parallel-size-local`
with the hybrid one (`--data-parallel-hybrid-lb`, `--data-parallel-start-rank`), and
`--data-parallel-size` otherwise; `--enable-elastic-ep` caps it at 1. With more than
one, run_multi_api_server raises "VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with
api_server_count > 1": an engine llmgw gives runtime LoRA (agent/engines/vllm.py) would
exit at every start. The real-engine tier compares `api_server_count` with what vLLM's
own cmd computes (tests/real_engine/vllm_args_check.py `api_servers`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmgw.model.deployment import Deployment
from llmgw.model.engine import EngineKind

# vLLM (0.32 envs.py) reads it as value.strip().lower() in ("1", "true").
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

# Every spelling argparse accepts for the options that decide the count (vLLM's own
# short aliases from engine/arg_utils.py and entrypoints/launchers/cli_args.py).
_VALUED = {
    "--api-server-count": "asc", "-asc": "asc",
    "--data-parallel-size": "dp", "-dp": "dp",
    "--data-parallel-size-local": "dpl", "-dpl": "dpl",
    "--data-parallel-rank": "dpn", "-dpn": "dpn",
    "--data-parallel-start-rank": "dpr", "-dpr": "dpr",
}  # fmt: skip
_SWITCHES = {
    "--headless": "headless",
    "--data-parallel-hybrid-lb": "hybrid", "-dph": "hybrid",
    "--data-parallel-external-lb": "external", "-dpe": "external",
    "--data-parallel-multi-port-external-lb": "multi_port", "-dpm": "multi_port",
    "--enable-elastic-ep": "elastic",
}  # fmt: skip


def _flag(token: str) -> str:
    # vLLM's FlexibleArgumentParser takes --data_parallel_size for --data-parallel-size.
    return "--" + token[2:].replace("_", "-") if token.startswith("--") else token


def _read(args: Sequence[str]) -> tuple[dict[str, str], dict[str, bool]]:
    """The last value of each counted option and the state of each switch, as argparse
    leaves them (a later occurrence wins; `--no-X` turns a boolean option off)."""
    values: dict[str, str] = {}
    switches: dict[str, bool] = {}
    i = 0
    while i < len(args):
        token = args[i]
        name, eq, inline = _flag(token).partition("=")
        if name in _VALUED:
            if eq:
                values[_VALUED[name]] = inline
            elif i + 1 < len(args):
                values[_VALUED[name]] = args[i + 1]
                i += 1
        elif name in _SWITCHES:
            switches[_SWITCHES[name]] = True
        elif name.startswith("--no-") and "--" + name[5:] in _SWITCHES:
            switches[_SWITCHES["--" + name[5:]]] = False
        i += 1
    return values, switches


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None  # vLLM's parser refuses it at start, with its own message


def api_server_count(args: Sequence[str]) -> int:
    """The API server processes `vllm serve MODEL *args` runs (vLLM 0.32's rule)."""
    values, on = _read(args)
    count = _int(values.get("asc"))
    if on.get("headless"):
        return 0
    external = on.get("external", False) or values.get("dpn") is not None
    multi_port = on.get("multi_port", False)
    hybrid = on.get("hybrid", False)
    if not hybrid and not multi_port:
        hybrid = values.get("dpr") is not None  # --data-parallel-start-rank implies it
    if count is None:
        if multi_port or external:
            count = 1
        elif hybrid:
            count = _int(values.get("dpl")) or 1
        else:
            count = _int(values.get("dp")) or 1
    if on.get("elastic") and count > 1:
        count = 1
    return count


def data_parallel_size(args: Sequence[str]) -> int:
    """`--data-parallel-size` as vLLM's parser leaves it (1 when unset or unreadable)."""
    return _int(_read(args)[0].get("dp")) or 1


def runtime_lora_on(env: Mapping[str, str], lora_slots: int) -> bool:
    """Whether the engine runs with runtime LoRA updating: the agent sets it wherever LoRA
    is enabled, unless the deployment's own env says otherwise."""
    if RUNTIME_LORA_ENV in env:
        return env[RUNTIME_LORA_ENV].strip().lower() in ("1", "true")
    return lora_slots > 0


def runtime_lora_refusal(args: Sequence[str], env: Mapping[str, str], lora_slots: int) -> str:
    """"" when vLLM accepts the combination; else why it would refuse to start."""
    if not runtime_lora_on(env, lora_slots):
        return ""
    n = api_server_count(args)
    if n <= 1:
        return ""
    return (f"vLLM runs {n} API server processes with these args (--api-server-count, or data "
            f"parallelism's default of one per rank) and refuses {RUNTIME_LORA_ENV}, which "
            "llmgw sets to load adapters at runtime: use --api-server-count 1, or serve the "
            "adapters without LoRA on this deployment")


# SGLang 0.5.23's data parallelism (srt/arg_groups/fields/parallel.py: dp_size and
# attn_dp_size with their aliases; the deprecated --enable-dp-attention only turns
# --dp-size into attention DP, parallel_hook.py).
_SGLANG_DP = ("--dp-size", "--data-parallel-size", "--attn-dp-size", "--attention-data-parallel-size")
_KV_FLAG = "--kv-events-config"


def _values(args: Sequence[str], names: Sequence[str]) -> list[str]:
    """Every value given to one of `names` (--name V or --name=V, dashes or underscores)."""
    out = []
    for i, token in enumerate(args):
        name, eq, inline = _flag(token).partition("=")
        if name in names:
            out.append(inline if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return out


def takes_priority(d: Deployment) -> bool:
    """Whether the deployment's engines order their waiting queue by the request's
    `priority`: vLLM with `--scheduling-policy priority` (0.32 engine/arg_utils.py:1744-1745;
    argparse keeps the last one given). The routers then write the field from the
    request's class (router/routing/priority.py)."""
    if d.engine is not EngineKind.VLLM:
        return False
    given = _values(d.args, ("--scheduling-policy",))
    return bool(given) and given[-1] == "priority"


def kv_events_refusal(d: Deployment) -> str:
    """"" unless the deployment asks for kv_events with args that undo it: its own
    --kv-events-config (argparse keeps the later one, the deployment's, and the agent
    would listen where nothing publishes), or data parallelism, which offsets the
    engine's event ports by the rank (vLLM 0.32 and SGLang 0.5.23 offset_endpoint_port)
    beyond the two the engine's port block holds for them."""
    if not d.kv_events:
        return ""
    if any(_flag(t).partition("=")[0] == _KV_FLAG for t in d.args):
        return (f"kv_events sets {_KV_FLAG} itself (a loopback socket the agent listens on): "
                "leave it out of args, or turn kv_events off to publish where you choose")
    if d.engine is EngineKind.VLLM:
        dp = data_parallel_size(d.args)
    else:
        dp = max([_int(v) or 1 for v in _values(d.args, _SGLANG_DP)], default=1)
    if dp > 1:
        return (f"kv_events with data parallelism ({dp} ranks): each rank publishes on ports "
                "offset by its rank, which the engine's port block has no room for; run the "
                "ranks as replicas instead, or turn kv_events off")
    return ""


def apply_refusal(d: Deployment) -> str:
    """"" when a deployment may be applied as far as the engines' serve rules go; else why
    not. Checked at apply (ctl's file and the server's ApplyOp), not when a stored
    deployment is read back: a server must still load the state an older version accepted."""
    if d.engine not in (EngineKind.VLLM, EngineKind.SGLANG):
        return ""
    kv = kv_events_refusal(d)
    if kv or d.engine is not EngineKind.VLLM:
        return kv
    return runtime_lora_refusal(d.args, d.env, d.lora_slots)
