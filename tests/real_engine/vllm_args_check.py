"""Parse argv lists with the installed vLLM's own `vllm serve` argument parser.

Run with the vLLM venv's python: reads a JSON list of argv lists (each starting with
"serve", the binary left off) on stdin; prints a JSON list with, per argv, either
{"ok": true, "args": {...}} (the parsed values of the flags llmgw sets) or
{"ok": false, "error": "..."}. Builds the parser exactly as `vllm`'s main() does and runs
the serve subcommand's own validation, so a renamed or removed flag is an error here.

With the argument `devices` it reads a JSON list of environments instead (what llmgw's
plans give engine processes) and prints, per environment, what vLLM's own Platform code
makes of CUDA_VISIBLE_DEVICES: the physical (NVML) id of each local rank, through
Platform.device_id_to_physical_device_id, visible_device_id_to_physical_device_id and
logical_device_id_to_visible_device_id, or the error it raises. vLLM's CUDA platform
cannot be imported from the CPU build (it needs vllm._C_stable_libtorch), so the check
runs those methods, which CudaPlatform inherits, on a Platform whose
device_control_env_var is read from vllm/platforms/cuda.py's CudaPlatform itself.

With `kv_events` it prints, per argv, the KVEventsConfig vLLM builds from it.

With `ports` it reads a JSON list of {"env": {...}, "hold": [ports]} and prints, per item,
the ports vLLM's own get_open_port() and get_open_ports_list(5) pick under that environment
while this process holds (listens on) the `hold` ports.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import sys
from typing import Any

KEYS = ("model_tag", "host", "port", "served_model_name", "tensor_parallel_size",
        "pipeline_parallel_size", "distributed_executor_backend", "nnodes", "node_rank",
        "master_addr", "master_port", "headless", "max_model_len", "enforce_eager",
        "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "enable_sleep_mode",
        "download_dir", "scheduling_policy")


def main() -> None:
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argvs = json.load(sys.stdin)
    out = []
    for argv in argvs:
        parser = FlexibleArgumentParser(description="vLLM CLI")
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        cmd = serve.ServeSubcommand()
        serve_parser = cmd.subparser_init(subparsers)
        # argparse takes an unambiguous prefix of a flag: a flag renamed to a longer name
        # would still parse. llmgw's flags must be vLLM's exact option strings.
        known = {o for a in serve_parser._actions for o in a.option_strings}
        inexact = [t.split("=", 1)[0] for t in argv
                   if t.startswith("--") and t.split("=", 1)[0] not in known]
        if inexact:
            out.append({"ok": False, "error": f"not an exact vllm serve flag: {', '.join(inexact)}"})
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv)
                cmd.validate(args)
                if args.enable_lora:
                    # The LoRA limits through vLLM's own LoRAConfig validator (e.g.
                    # max_cpu_loras >= max_loras), as the engine builds it at start.
                    from vllm.config.lora import LoRAConfig

                    LoRAConfig(max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
                               max_cpu_loras=args.max_cpu_loras)
        except SystemExit as exc:
            out.append({"ok": False, "error": f"exit {exc.code}: {err.getvalue().strip()[-2000:]}"})
            continue
        except Exception as exc:  # validation errors
            out.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        out.append({"ok": True, "args": {k: getattr(args, k, None) for k in KEYS}})
    json.dump(out, sys.stdout, default=str)


# vLLM 0.32's CUDA platform classes (vllm/platforms/cuda.py): CudaPlatform is one of the last two.
CUDA_CLASSES = ("CudaPlatformBase", "NvmlCudaPlatform", "NonNvmlCudaPlatform")


def _cuda_class_attrs() -> tuple[str, dict[str, list[str]]]:
    """The CUDA platform's device_control_env_var and the methods each of its classes
    defines, read from vllm/platforms/cuda.py's source."""
    import vllm.platforms

    path = os.path.join(os.path.dirname(vllm.platforms.__file__), "cuda.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    env_var = ""
    methods: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in CUDA_CLASSES:
            methods[node.name] = []
            for item in node.body:
                if isinstance(item, ast.AnnAssign | ast.Assign):
                    targets = [item.target] if isinstance(item, ast.AnnAssign) else item.targets
                    names = [t.id for t in targets if isinstance(t, ast.Name)]
                    if "device_control_env_var" in names and isinstance(item.value, ast.Constant):
                        env_var = str(item.value.value)
                elif isinstance(item, ast.FunctionDef):
                    methods[node.name].append(item.name)
    return env_var, methods


def devices() -> None:
    from vllm.platforms.interface import Platform

    env_var, methods = _cuda_class_attrs()

    class Cuda(Platform):  # type: ignore[misc, valid-type]
        device_name = "cuda"
        device_control_env_var = env_var

    out: dict[str, object] = {"device_control_env_var": env_var, "cuda_methods": methods, "results": []}
    for env in json.load(sys.stdin):
        saved = dict(os.environ)
        os.environ.update(env)
        n = len(env.get(env_var, "").split(","))
        try:
            res = {
                "ok": True,
                "physical": [Cuda.device_id_to_physical_device_id(i) for i in range(n)],
                "visible_to_physical": [Cuda.visible_device_id_to_physical_device_id(i) for i in range(n)],
                "logical_to_visible": [Cuda.logical_device_id_to_visible_device_id(i) for i in range(n)],
            }
        except Exception as exc:  # what vLLM raises on a value it cannot use
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            os.environ.clear()
            os.environ.update(saved)
        out["results"].append(res)  # type: ignore[attr-defined]
    json.dump(out, sys.stdout)


def ports() -> None:
    import socket

    from vllm.utils.network_utils import get_open_port, get_open_ports_list

    out = []
    for item in json.load(sys.stdin):
        saved = dict(os.environ)
        os.environ.update(item["env"])
        held = []
        try:
            for port in item["hold"]:
                s = socket.socket()
                s.bind(("", port))
                s.listen()
                held.append(s)
            out.append({"open_port": get_open_port(), "open_ports": sorted(get_open_ports_list(5))})
        finally:
            for s in held:
                s.close()
            os.environ.clear()
            os.environ.update(saved)
    json.dump(out, sys.stdout)


def _serve_parser():  # type: ignore[no-untyped-def]
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    cmd = serve.ServeSubcommand()
    cmd.subparser_init(parser.add_subparsers(required=False, dest="subparser"))
    return parser, cmd


def api_servers() -> None:
    """Per argv (as in main), the API server count vLLM's own ServeSubcommand.cmd settles
    on: cmd runs as it is, with the launchers it would call replaced by recorders."""
    import vllm.entrypoints.cli.serve as serve

    seen: list[int] = []
    serve.run_headless = lambda args: seen.append(0)
    serve.run_multi_api_server = lambda args: seen.append(args.api_server_count)
    serve.run_dp_supervisor = lambda args: seen.append(1)  # one API server per local rank, each alone
    serve.run_server = lambda args: seen.append(1)  # cmd set api_server_count to None: this process
    serve.uvloop.run = lambda coro: None
    out = []
    for argv in json.load(sys.stdin):
        parser, cmd = _serve_parser()
        seen.clear()
        args = parser.parse_args(argv)
        cmd.validate(args)
        cmd.cmd(args)
        out.append(seen[-1])
    json.dump(out, sys.stdout)


def lora() -> None:
    """Per argv, every LoRA field of the engine arguments vLLM builds from it: what its
    workers' lora_config is made of (engine/arg_utils.py create_engine_config)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    out = []
    for argv in json.load(sys.stdin):
        parser, _ = _serve_parser()
        engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args(argv))
        out.append({k: getattr(engine_args, k) for k in sorted(vars(engine_args)) if "lora" in k})
    json.dump(out, sys.stdout, default=str)


def kv_events() -> None:
    """Per argv, the KVEventsConfig vLLM's engine arguments carry (engine/arg_utils.py,
    --kv-events-config parsed into config/kv_events.py's class, __post_init__ run), as a
    dict; None where the argv sets none."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    out = []
    for argv in json.load(sys.stdin):
        parser, cmd = _serve_parser()
        args = parser.parse_args(argv)
        cmd.validate(args)
        cfg = AsyncEngineArgs.from_cli_args(args).kv_events_config
        out.append(None if cfg is None else {"class": type(cfg).__qualname__, **dataclasses.asdict(cfg)})
    json.dump(out, sys.stdout, default=str)


def priority() -> None:
    """vLLM's own request models and scheduler queue on a request's `priority`: the
    field's type and default on CompletionRequest and ChatCompletionRequest, what each
    makes of a few values, the engine config an argv builds (stdin's {"argv": [...]}), and
    the order vLLM's PriorityRequestQueue pops stdin's "requests" ([id, priority,
    arrival_time] each) in: its heap over Request.__lt__, run on stand-ins carrying the
    fields that method reads. The FCFS queue pops the same in arrival order."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
    from vllm.v1.request import Request

    bodies: dict[str, tuple[Any, dict[str, object]]] = {
              "completion": (CompletionRequest, {"model": "m", "prompt": "hi"}),
              "chat": (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})}
    out: dict[str, object] = {}
    for name, (cls, body) in bodies.items():
        field = cls.model_fields["priority"]
        got: dict[str, object] = {}
        for label, value in (("absent", None), ("-3", -3), ("7", 7), ("'2'", "2"),
                             ("'high'", "high"), ("1.5", 1.5), ("2**63", 2**63)):
            try:
                req = cls.model_validate(body if value is None else {**body, "priority": value})
                got[label] = req.priority
            except Exception as exc:  # pydantic's ValidationError: the engine answers 400
                got[label] = f"error: {type(exc).__name__}"
        out[name] = {"annotation": str(field.annotation), "default": field.default, "values": got}
    given = json.load(sys.stdin)
    parser, _ = _serve_parser()
    args = parser.parse_args(given["argv"])
    out["engine_scheduling_policy"] = AsyncEngineArgs.from_cli_args(args).scheduling_policy

    class Stand:  # what Request.__lt__ reads, and its order
        __lt__ = Request.__lt__

        def __init__(self, rid: str, priority: int, arrival: float) -> None:
            self.request_id, self.priority, self.arrival_time = rid, priority, arrival

    for policy in (SchedulingPolicy.PRIORITY, SchedulingPolicy.FCFS):
        q = create_request_queue(policy)
        for rid, prio, arrival in sorted(given["requests"], key=lambda r: r[2]):
            q.add_request(Stand(rid, prio, arrival))
        out[f"{policy.value}_pop_order"] = [q.pop_request().request_id for _ in range(len(q))]
    json.dump(out, sys.stdout, default=str)


if __name__ == "__main__":
    modes = {"devices": devices, "ports": ports, "api_servers": api_servers, "lora": lora,
             "kv_events": kv_events, "priority": priority}
    modes.get(sys.argv[1] if sys.argv[1:] else "", main)()
