"""`llmgw ctl ...`: each subcommand is one request to the server and one rendering."""

from __future__ import annotations

import argparse
import json
from typing import Any

import trio

from llmgw.ctl import render
from llmgw.ctl.settings import resolve
from llmgw.transport.client import request


def add_ctl_arguments(p: argparse.ArgumentParser, parser_class: type[argparse.ArgumentParser]) -> None:
    p.add_argument("--server", help="tcp://host:port (or LLMGW_SERVER)")
    p.add_argument("--key", help="this operator's secret key file (or LLMGW_CTL_KEY)")
    p.add_argument("--server-key", help="the server's public key file (or LLMGW_SERVER_KEY)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    sub = p.add_subparsers(dest="ctl_cmd", required=True, parser_class=parser_class)

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help)
        c.add_argument("-o", "--output", choices=["table", "json"], default="table")
        return c

    cmd("status", "nodes, fabrics, deployments and replicas")
    cmd("apply", "create or update a deployment from a file").add_argument(
        "-f", "--file", required=True, help="deployment YAML")
    cmd("get", "list deployments, replicas or nodes").add_argument(
        "what", choices=["deployments", "replicas", "nodes"])
    d = cmd("describe", "a deployment: spec, replicas, events, why anything is pending")
    d.add_argument("kind", choices=["deployment"])
    d.add_argument("name")
    de = cmd("delete", "delete a deployment (its engines are stopped)")
    de.add_argument("kind", choices=["deployment"])
    de.add_argument("name")
    sc = cmd("scale", "set a deployment's replica count")
    sc.add_argument("name")
    sc.add_argument("--replicas", type=int, required=True)
    for name, help in [("cordon", "place nothing new on a node"),
                       ("uncordon", "let placement use a node again"),
                       ("drain", "cordon a node and move its replicas away (new ready first)")]:
        cmd(name, help).add_argument("node")
    cmd("rediscover", "ask nodes to run discovery now (all nodes when none named)").add_argument(
        "nodes", nargs="*")
    lg = cmd("logs", "an engine's log tail, fetched from its node")
    lg.add_argument("replica")
    lg.add_argument("--lines", type=int, default=200)


def call(args: argparse.Namespace, op: str, params: dict[str, Any] | None = None) -> Any:
    settings = resolve(args.server, args.key, args.server_key)
    return trio.run(request, settings.server, settings.key, settings.server_key, op, params or {},
                    args.timeout)


def _params(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    c = args.ctl_cmd
    if c == "apply":
        from llmgw.config._strict import read_yaml
        from llmgw.config.deployment import load_deployment

        load_deployment(args.file)  # a bad file is the operator's to fix, before sending
        return "apply", {"spec": read_yaml(args.file), "source": args.file}
    if c == "get":
        return "get", {"what": args.what}
    if c in ("describe", "delete"):
        return c, {"name": args.name}
    if c == "scale":
        return "scale", {"name": args.name, "replicas": args.replicas}
    if c in ("cordon", "uncordon", "drain"):
        return "cordon", {"node": args.node, "cordoned": c != "uncordon", "draining": c == "drain"}
    if c == "rediscover":
        return "rediscover", {"nodes": args.nodes}
    if c == "logs":
        return "logs", {"replica": args.replica, "lines": args.lines}
    return c, {}


def run_ctl(args: argparse.Namespace) -> None:
    op, params = _params(args)
    result = call(args, op, params)
    if args.output == "json":
        print(json.dumps(result, indent=2))
    else:
        print(render.render(args.ctl_cmd, args, result))
