"""`llmgw ctl ...`: each subcommand is one request to the server and one rendering."""

from __future__ import annotations

import argparse
import json
from typing import Any

import trio

from llmgw.ctl.render import render_status
from llmgw.ctl.settings import resolve
from llmgw.transport.client import request


def add_ctl_arguments(p: argparse.ArgumentParser, parser_class: type[argparse.ArgumentParser]) -> None:
    p.add_argument("--server", help="tcp://host:port (or LLMGW_SERVER)")
    p.add_argument("--key", help="this operator's secret key file (or LLMGW_CTL_KEY)")
    p.add_argument("--server-key", help="the server's public key file (or LLMGW_SERVER_KEY)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    sub = p.add_subparsers(dest="ctl_cmd", required=True, parser_class=parser_class)
    st = sub.add_parser("status", help="nodes, fabrics, deployments and replicas")
    st.add_argument("-o", "--output", choices=["table", "json"], default="table")


def call(args: argparse.Namespace, op: str, params: dict[str, Any] | None = None) -> Any:
    settings = resolve(args.server, args.key, args.server_key)
    return trio.run(request, settings.server, settings.key, settings.server_key, op, params or {},
                    args.timeout)


def run_ctl(args: argparse.Namespace) -> None:
    if args.ctl_cmd == "status":
        result = call(args, "status")
        if args.output == "json":
            print(json.dumps(result, indent=2))
        else:
            print(render_status(result))
