"""`llmgw ctl ...`: each subcommand is one request to the server and one rendering."""

from __future__ import annotations

import argparse
import json
from typing import Any

import trio

from llmgw.config.deployment import load_deployment
from llmgw.ctl import render
from llmgw.ctl.settings import resolve
from llmgw.transport.follow import request_leader
from llmgw.transport.requests import (
    ApplyOp,
    CordonOp,
    DeleteOp,
    DescribeOp,
    GetOp,
    GetWhat,
    LogsOp,
    Op,
    RediscoverOp,
    ScaleOp,
    StatusOp,
)


def add_ctl_arguments(p: argparse.ArgumentParser, parser_class: type[argparse.ArgumentParser]) -> None:
    p.add_argument("--server", action="append",
                   help="tcp://host:port, again for each server (or LLMGW_SERVER, comma-separated)")
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


def call(args: argparse.Namespace, op: Op) -> Any:
    settings = resolve(",".join(args.server) if args.server else None, args.key, args.server_key)
    servers = [s.strip() for s in settings.server.split(",") if s.strip()]
    return trio.run(request_leader, servers, settings.key, settings.server_key, op, args.timeout)


def op_of(args: argparse.Namespace) -> Op:
    """The request this command line asks for; a bad deployment file raises here, before
    anything is sent (the operator's to fix)."""
    c = args.ctl_cmd
    if c == "apply":
        return ApplyOp(load_deployment(args.file), args.file)
    if c == "get":
        return GetOp(GetWhat(args.what))
    if c == "describe":
        return DescribeOp(args.name)
    if c == "delete":
        return DeleteOp(args.name)
    if c == "scale":
        return ScaleOp(args.name, args.replicas)
    if c in ("cordon", "uncordon", "drain"):
        return CordonOp(args.node, cordoned=c != "uncordon", draining=c == "drain")
    if c == "rediscover":
        return RediscoverOp(tuple(args.nodes))
    if c == "logs":
        return LogsOp(args.replica, args.lines)
    return StatusOp()


def run_ctl(args: argparse.Namespace) -> None:
    result = call(args, op_of(args))
    if args.output == "json":
        print(json.dumps(result, indent=2))
    else:
        print(render.render(args.ctl_cmd, args, result))
