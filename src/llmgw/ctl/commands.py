"""`llmgw ctl ...`: each subcommand is one request to the server and one rendering
(`logs -f` is the same request, repeated)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import yaml

from llmgw.config.load_deployment import load_deployment
from llmgw.ctl import apikey, gpu, render, usage
from llmgw.ctl.follow import follow_window, new_lines
from llmgw.ctl.settings import default_file, resolve, servers_of
from llmgw.errors import RequestFailedError, UsageError
from llmgw.transport.client import request_leader
from llmgw.transport.requests import (
    MAX_LOG_LINES,
    ApplyOp,
    CordonOp,
    DeleteOp,
    DescribeOp,
    DescribeWhat,
    GetOp,
    GetWhat,
    LogsOp,
    Op,
    RediscoverOp,
    ScaleOp,
    StatusOp,
)

OUTPUTS = ("table", "wide", "json", "yaml", "csv")
DEFAULT_TIMEOUT = 5.0
FOLLOW_INTERVAL = 1.0  # seconds between log fetches of `logs -f`

# Every name ctl takes for a kind of object, kubectl's way: plural, singular, short.
KINDS = {
    "deployments": "deployment", "deployment": "deployment", "deploy": "deployment",
    "replicas": "replica", "replica": "replica",
    "nodes": "node", "node": "node", "no": "node",
}
KIND_HELP = "deployments|deployment|deploy, replicas|replica, nodes|node|no"

EPILOG = f"""\
where ctl finds the server and its keys, each from the first that has it:
  the flags --server, --key, --server-key;
  the environment: LLMGW_SERVER (comma-separated), LLMGW_CTL_KEY, LLMGW_SERVER_KEY;
  the file --config FILE, else the file LLMGW_CTL_CONFIG names, else
  {default_file()} ($XDG_CONFIG_HOME/llmgw/ctl.toml), e.g.
      server = "tcp://10.0.0.1:7443"
      key = "/etc/llmgw/keys/ops.key_secret"
      server_key = "/etc/llmgw/keys/server.key"

options may come before or after the subcommand: llmgw ctl -o json status == llmgw ctl status -o json

exit status: 0 ok, 1 the server refused the request, 2 usage or configuration,
3 identity (key refused, or wrong server_key), 4 server unreachable, 130 interrupted"""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds greater than 0, got {text!r}")
    return value


def _add_common(p: argparse.ArgumentParser, *, after_verb: bool) -> None:
    """The options every ctl subcommand takes, before or after the verb. After it they
    default to nothing (SUPPRESS), so that one given before it is kept."""
    d: dict[str, Any] = {"default": argparse.SUPPRESS} if after_verb else {}
    p.add_argument("--server", action="append", metavar="tcp://HOST:PORT",
                   dest="server_after" if after_verb else "server",
                   help="the server; again for each server of a PostgreSQL group (the "
                   "leader is found) (default: LLMGW_SERVER, then ctl.toml)", **d)
    p.add_argument("--key", metavar="FILE", **d,
                   help="this operator's secret key file, .key_secret "
                   "(default: LLMGW_CTL_KEY, then ctl.toml)")
    p.add_argument("--server-key", metavar="FILE", **d,
                   help="the server's public key file, server.key "
                   "(default: LLMGW_SERVER_KEY, then ctl.toml)")
    p.add_argument("--config", metavar="FILE", **d,
                   help="read server, key and server_key from this ctl.toml (default: "
                   "LLMGW_CTL_CONFIG, then $XDG_CONFIG_HOME/llmgw/ctl.toml; `llmgw dev` "
                   "writes one in its state folder)")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   **(d or {"default": DEFAULT_TIMEOUT}),
                   help=f"how long to wait for the server (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("-o", "--output", choices=OUTPUTS, metavar="FORMAT",
                   **(d or {"default": "table"}),
                   help="table (default), wide (more columns), json or yaml (csv: ctl usage)")
    # Never a default here: it would hide `llmgw -v ctl ...` (the top level has one).
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging")


def add_ctl_arguments(p: argparse.ArgumentParser, parser_class: type[argparse.ArgumentParser]) -> None:
    p.description = ("Operate the cluster: each subcommand is one request to the server, "
                     "over CURVE with an admin key.")
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    _add_common(p, after_verb=False)
    sub = p.add_subparsers(dest="ctl_cmd", metavar="SUBCOMMAND", parser_class=parser_class)
    p.set_defaults(ctl_cmd=None)

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".")
        _add_common(c, after_verb=True)
        return c

    cmd("status", "nodes, fabrics, deployments and replicas")
    cmd("apply", "create or update a deployment from a file").add_argument(
        "-f", "--file", required=True, metavar="FILE", help="the deployment's YAML file")
    g = cmd("get", "list deployments, replicas or nodes, or show one")
    g.add_argument("kind", metavar="KIND", help=KIND_HELP)
    g.add_argument("name", metavar="NAME", nargs="?", help="only this one")
    d = cmd("describe", "one deployment, node or replica in full: spec, replicas, events, "
            "why anything is pending")
    d.add_argument("kind", metavar="KIND", help="deployment|deploy, node|no, replica")
    d.add_argument("name", metavar="NAME", help="its name (a replica's id, e.g. llama-70b-0)")
    de = cmd("delete", "delete a deployment (its engines are stopped)")
    de.add_argument("kind", metavar="KIND", help="deployment|deploy")
    de.add_argument("name", metavar="NAME", help="the deployment's name")
    sc = cmd("scale", "set a deployment's replica count")
    sc.add_argument("name", metavar="NAME", help="the deployment's name")
    sc.add_argument("--replicas", type=int, required=True, metavar="N", help="how many replicas")
    sc.add_argument("--pin", action="store_true",
                    help="on a deployment with autoscale: set the count anyway and switch "
                         "autoscale off for it until its next apply")
    for name, help in [("cordon", "place nothing new on a node"),
                       ("uncordon", "let placement use a node again"),
                       ("drain", "cordon a node and move its replicas away (new ready first)")]:
        cmd(name, help).add_argument("node", metavar="NODE", help="the node's id")
    cmd("rediscover", "ask nodes to run discovery now (all nodes when none named)").add_argument(
        "nodes", nargs="*", metavar="NODE", help="a node's id")
    lg = cmd("logs", "an engine's log tail, fetched from its node")
    lg.add_argument("replica", metavar="REPLICA", help="the replica's id, e.g. llama-70b-0")
    lg.add_argument("-n", "--lines", type=int, default=200, metavar="N",
                    help=f"how many lines from the end (default 200, at most {MAX_LOG_LINES})")
    lg.add_argument("-f", "--follow", action="store_true",
                    help="keep printing new lines as they come (Ctrl-C ends)")
    apikey.add_arguments(cmd, lambda v: _add_common(v, after_verb=True), parser_class)
    usage.add_arguments(cmd)
    gpu.add_arguments(cmd, lambda v: _add_common(v, after_verb=True), parser_class)


def normalize(args: argparse.Namespace) -> argparse.Namespace:
    """Fold the options given after the verb into those given before it."""
    after = getattr(args, "server_after", None)
    if after:
        args.server = [*(args.server or []), *after]
    return args


def kind_of(cmd: str, word: str, allowed: tuple[str, ...]) -> str:
    kind = KINDS.get(word.lower())
    if kind is None or kind not in allowed:
        names = ", ".join(k for k, v in KINDS.items() if v in allowed)
        raise UsageError(f"ctl {cmd}: unknown kind {word!r} (choose from {names})")
    return kind


def op_of(args: argparse.Namespace) -> Op:
    """The request this command line asks for; a bad deployment file raises here, before
    anything is sent (the operator's to fix)."""
    c = args.ctl_cmd
    if args.output == "csv" and c != "usage":
        raise UsageError(f"ctl {c}: -o csv is for ctl usage; use table, wide, json or yaml")
    if c == "apikey":
        return apikey.op_of(args)
    if c == "usage":
        return usage.op_of(args)
    if c == "gpu":
        return gpu.op_of(args)
    if c == "apply":
        return ApplyOp(load_deployment(args.file), args.file)
    if c == "get":
        return GetOp(GetWhat(kind_of(c, args.kind, ("deployment", "replica", "node")) + "s"))
    if c == "describe":
        return DescribeOp(args.name, DescribeWhat(
            kind_of(c, args.kind, ("deployment", "replica", "node"))))
    if c == "delete":
        kind_of(c, args.kind, ("deployment",))
        return DeleteOp(args.name)
    if c == "scale":
        return ScaleOp(args.name, args.replicas, pin=args.pin)
    if c in ("cordon", "uncordon", "drain"):
        return CordonOp(args.node, cordoned=c != "uncordon", draining=c == "drain")
    if c == "rediscover":
        return RediscoverOp(tuple(args.nodes))
    if c == "logs":
        if not 1 <= args.lines <= MAX_LOG_LINES:
            raise UsageError(f"ctl logs: -n/--lines: expected 1 to {MAX_LOG_LINES}, got {args.lines}")
        if args.follow and args.output in ("json", "yaml"):
            raise UsageError("ctl logs: -f prints lines as they come; -o json|yaml is for "
                             "one fetch without -f")
        return LogsOp(args.replica, follow_window(args.lines) if args.follow else args.lines)
    return StatusOp()


Ask = Callable[[Op], Awaitable[Any]]


def asker(args: argparse.Namespace) -> Ask:
    settings = resolve(",".join(args.server) if args.server else None, args.key, args.server_key,
                       config=args.config)
    servers = servers_of(settings)

    async def ask(op: Op) -> Any:
        return await request_leader(servers, settings.key, settings.server_key, op, args.timeout)

    return ask


def only(kind: str, name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The one row of `get KIND NAME`."""
    key = "name" if kind == "deployment" else "id"
    for row in rows:
        if row.get(key) == name:
            return row
    raise RequestFailedError(f"no {kind} named {name!r}")


def formatted(args: argparse.Namespace, result: Any) -> str:
    if args.ctl_cmd == "usage" and args.output in ("table", "wide", "csv"):
        return usage.render(args, result)
    if args.ctl_cmd == "apikey":
        if args.output in ("table", "wide"):
            return apikey.render(args, result)
        result = apikey.plain(args, result)
    if args.ctl_cmd == "gpu" and args.output in ("table", "wide"):
        return gpu.render(result)
    if args.output == "json":
        return json.dumps(result, indent=2)
    if args.output == "yaml":
        return yaml.safe_dump(result, sort_keys=False, default_flow_style=False).rstrip("\n")
    kind = KINDS.get(getattr(args, "kind", ""), "")
    return render.render(args.ctl_cmd, kind, result, wide=args.output == "wide")


def _print(text: str) -> None:
    print(text, flush=True)


async def follow_logs(ask: Ask, op: LogsOp, lines: int, interval: float = FOLLOW_INTERVAL,
                      out: Callable[[str], None] = _print) -> None:
    """Print the last `lines` lines, then new ones as they come, until cancelled. Each
    fetch is a tail of `op.lines`; what is new is found by where the tails overlap."""
    first = await ask(op)
    out(render.logs_head(first))
    prev = list(first["lines"])
    for line in prev[-lines:]:
        out(line)
    while True:
        await trio.sleep(interval)
        cur = list((await ask(op))["lines"])
        fresh, gap = new_lines(prev, cur)
        if gap:
            print("# (the log was rotated or ran ahead of this poll; some lines may be missing)",
                  file=sys.stderr, flush=True)
        for line in fresh:
            out(line)
        prev = cur


def run_ctl(args: argparse.Namespace) -> None:
    args = normalize(args)
    op = op_of(args)
    ask = asker(args)
    if isinstance(op, LogsOp) and args.follow:
        trio.run(follow_logs, ask, op, args.lines)
        return
    result = trio.run(ask, op)
    if args.ctl_cmd == "get" and args.name:
        result = only(KINDS[args.kind.lower()], args.name, result)
    _print(formatted(args, result))
