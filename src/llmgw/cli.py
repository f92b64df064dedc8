"""`llmgw`: parse the command line, load config, call one run function.

This is the one place that turns LlmgwError into a message and an exit status; an
operator's mistake never shows a traceback. Every message reads `llmgw: <message>`, on
one line, and the statuses are those of llmgw.errors (docs/operating.md, "Exit codes"). A bare
`llmgw`, `llmgw ctl`, `llmgw keys` or `llmgw config` prints its help and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

import trio

from llmgw.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, InternalError, LlmgwError, UsageError

log = logging.getLogger("llmgw")

_ARGUMENT = re.compile(r"^argument (\S+?): ")
_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


def usage_message(prog: str, message: str) -> str:
    """argparse's complaint as one line for the operator: no `argument what:`, the
    subcommand named, and where to read more."""
    choice = _CHOICE.search(message)
    if choice is not None:
        options = choice.group(2).replace("'", "")
        if message.startswith(("argument COMMAND:", "argument SUBCOMMAND:")):
            message = f"unknown command {choice.group(1)!r} (choose from {options})"
        else:
            message = message[:choice.start()] + f"{choice.group(1)!r} is not one of {options}"
    message = _ARGUMENT.sub(r"\1: ", message)
    where = prog.removeprefix("llmgw").strip()
    return f"{where + ': ' if where else ''}{message} (see `{prog} --help`)"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(usage_message(self.prog, message))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmgw")
    except PackageNotFoundError:  # run from a source tree that pip never installed
        from llmgw import __version__

        return __version__


def _help_of(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    def show(args: argparse.Namespace) -> None:
        parser.print_help()

    return show


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def _until_signalled(run: Callable[[], Awaitable[None]]) -> None:
    """Run until done, or until SIGTERM/SIGINT, then cancel cleanly."""
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

        async def main() -> None:
            await run()
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        nursery.start_soon(main)


def _leaf(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first `kind` in `exc`, looking inside exception groups (trio's nurseries)."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _leaf(sub, kind)
            if found is not None:
                return found
    return None


def _leaf_error(exc: BaseException) -> LlmgwError | None:
    found = _leaf(exc, LlmgwError)
    return found if isinstance(found, LlmgwError) else None


# ---- commands ----


def cmd_server(args: argparse.Namespace) -> None:
    from llmgw.config.load_server import load_server_config
    from llmgw.server.main import run_server

    config = load_server_config(args.config)
    trio.run(_until_signalled, lambda: run_server(config))


def cmd_agent(args: argparse.Namespace) -> None:
    from llmgw.agent.run import Agent
    from llmgw.config.load_agent import load_agent_config

    config = load_agent_config(args.config)
    agent = Agent(config)
    trio.run(_until_signalled, agent.serve)


def cmd_router(args: argparse.Namespace) -> None:
    from llmgw.config.load_router import load_router_config
    from llmgw.router.service import run_router
    from llmgw.transport.client import request

    config = load_router_config(args.config)
    trio.run(_until_signalled, lambda: run_router(config, request))


def cmd_dev(args: argparse.Namespace) -> None:
    from llmgw.dev import DevOptions, run_dev

    opts = DevOptions(
        state_dir=args.state_dir,
        demo=not args.no_demo,
        port_base=args.port_base,
        router_port=args.router_port,
        real_gpus=args.real_gpus,
        simulated_gpus=args.simulated_gpus,
        vllm_bin=args.vllm_bin,
        sglang_python=args.sglang_python,
    )
    trio.run(run_dev, opts)


def cmd_keys(args: argparse.Namespace) -> None:
    from llmgw.transport import keys

    if args.keys_cmd in ("init", "issue"):
        to = keys.handover(args.owner, args.group)
        mode = f"mode {to.mode:04o}" + (f", owner {args.owner}" if args.owner else "") + (
            f", group {args.group}" if args.group else "")
    if args.keys_cmd == "init":
        d = keys.init_keys(args.dir, to)
        print(f"wrote {d / 'server.key'} and {d / 'server.key_secret'} ({mode}); authorized keys "
              f"go in {d / 'authorized'}")
    elif args.keys_cmd == "issue":
        pub, sec = keys.issue_key(args.dir, args.role, args.name, args.out, to)
        print(f"wrote {pub} and {sec} ({mode}); {args.role} {args.name!r} is authorized")
    elif args.keys_cmd == "list":
        from llmgw.ctl.render import table

        rows = [[k.name, k.role, k.public_key.decode()] for k in keys.list_keys(args.dir)]
        print(table(["NAME", "ROLE", "PUBLIC KEY"], rows))
    elif args.keys_cmd == "revoke":
        dst = keys.revoke_key(args.dir, args.name)
        print(f"revoked {args.name!r} (moved to {dst}); the server cuts it within one heartbeat")


def cmd_config(args: argparse.Namespace) -> None:
    from llmgw import examples

    if args.config_cmd is None:
        args.config_help.print_help()
    elif args.name is None:
        sys.stdout.write(examples.listing())
    else:
        sys.stdout.write(examples.example_text(args.name))


def cmd_ctl(args: argparse.Namespace) -> None:
    from llmgw.ctl.commands import run_ctl

    if args.ctl_cmd is None:
        args.ctl_help.print_help()
        return
    run_ctl(args)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="llmgw", description="LLM inference on bare-metal GPU clusters.",
                epilog="exit status: 0 ok, 1 the server refused the request, 2 usage or "
                "configuration, 3 identity (key refused, or wrong server_key), 4 server "
                "unreachable, 130 interrupted")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"llmgw {_version()}",
                   help="print llmgw's version and exit")
    p.set_defaults(func=_help_of(p))
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)

    s = sub.add_parser("server", help="run the control plane")
    s.add_argument("--config", required=True, metavar="FILE", help="server.toml")
    s.set_defaults(func=cmd_server)

    a = sub.add_parser("agent", help="run the node agent")
    a.add_argument("--config", required=True, metavar="FILE", help="agent.yaml")
    a.set_defaults(func=cmd_agent)

    r = sub.add_parser("router", help="run the OpenAI-compatible router")
    r.add_argument("--config", required=True, metavar="FILE", help="router.toml")
    r.set_defaults(func=cmd_router)

    dv = sub.add_parser(
        "dev",
        help="server, agent and router in one process, for trying llmgw on this machine",
        description="Server, one agent and the router in one process on this machine, with "
        "keys and state in a scratch folder and CURVE on as always. Simulated GPUs and the "
        "simulated engine unless told otherwise. Applies a demo deployment, waits until it "
        "is ready and prints how to reach it. Ctrl-C stops everything, engines included.",
    )
    dv.add_argument("--state-dir", default=None, metavar="DIR",
                    help="keep keys, configs and state here, reused on the next run "
                    "(default: a scratch folder removed on exit)")
    dv.add_argument("--no-demo", action="store_true", help="do not apply the demo deployment")
    dv.add_argument("--port-base", type=int, default=20000, metavar="PORT",
                    help="first port of the 1000 that engines are given (default 20000)")
    dv.add_argument("--router-port", type=int, default=8080, metavar="PORT",
                    help="the router's HTTP port on 127.0.0.1 (default 8080; 0: any free port)")
    dv.add_argument("--real-gpus", action="store_true",
                    help="use this machine's GPUs where it has any (default: simulated GPUs)")
    dv.add_argument("--simulated-gpus", type=int, default=2, metavar="N",
                    help="how many simulated GPUs the agent reports (default 2)")
    dv.add_argument("--vllm-bin", default="", metavar="PATH",
                    help="the vllm program vLLM deployments run, e.g. VENV/bin/vllm "
                    "(engines.vllm.bin; default: vllm on PATH)")
    dv.add_argument("--sglang-python", default="", metavar="PATH",
                    help="the python that runs SGLang deployments, with sglang installed "
                    "(engines.sglang.python; default: python3 on PATH)")
    dv.set_defaults(func=cmd_dev)

    k = sub.add_parser("keys", help="CURVE key pairs",
                       description="CURVE key pairs: the server's, and one per node, admin "
                       "and router, authorized by being in the server's authorized folder.")
    k.set_defaults(func=_help_of(k))
    ksub = k.add_subparsers(dest="keys_cmd", metavar="SUBCOMMAND", parser_class=_Parser)

    def keys_dir(kp: argparse.ArgumentParser) -> None:
        kp.add_argument("--dir", required=True, metavar="DIR", help="the server's keys folder")

    ki = ksub.add_parser("init", help="the server's pair and the authorized folder")
    keys_dir(ki)
    kis = ksub.add_parser("issue", help="a pair for a node, admin or router, authorized")
    kis.add_argument("role", choices=["node", "admin", "router"], metavar="ROLE",
                     help="node, admin or router")
    kis.add_argument("name", metavar="NAME", help="the identity: a node's node_id, an "
                     "operator's or a router's name")
    keys_dir(kis)
    kis.add_argument("--out", default=None, metavar="DIR",
                     help="where to write the pair (default: --dir)")
    for kp in (ki, kis):
        # A server or router under systemd runs as User=llmgw and must read its secret.
        kp.add_argument("--owner", default=None, metavar="USER[:GROUP]",
                        help="hand the secret key file to this user (and group), mode 0600; "
                        "for a daemon that runs as a service user (root only)")
        kp.add_argument("--group", default=None, metavar="GROUP",
                        help="let this group read the secret key file (mode 0640)")
    kl = ksub.add_parser("list", help="authorized keys")
    keys_dir(kl)
    kr = ksub.add_parser("revoke", help="take a key out of the authorized folder")
    kr.add_argument("name", metavar="NAME", help="the key's name")
    keys_dir(kr)
    for kp in (ki, kis, kl, kr):
        kp.set_defaults(func=cmd_keys)

    cf = sub.add_parser("config", help="the annotated example files (configs, units)",
                        description="The annotated example files that ship with llmgw: "
                        "configurations, deployments, systemd units.")
    cf.set_defaults(func=cmd_config, config_help=cf)
    cfsub = cf.add_subparsers(dest="config_cmd", metavar="SUBCOMMAND", parser_class=_Parser)
    ce = cfsub.add_parser("example", help="print an example file (no NAME: list them)",
                          description="Print an annotated example file to stdout, e.g. "
                          "`llmgw config example server > /etc/llmgw/server.toml`.")
    ce.add_argument("name", nargs="?", default=None, metavar="NAME",
                    help="which example (leave out to list them)")
    ce.set_defaults(func=cmd_config, config_help=cf)

    c = sub.add_parser("ctl", help="operate the cluster")
    from llmgw.ctl.commands import add_ctl_arguments

    add_ctl_arguments(c, _Parser)
    c.set_defaults(func=cmd_ctl, ctl_help=c)
    return p


def _quiet_stdout() -> None:
    """After a broken pipe (`llmgw ctl status | head -1`): point stdout at /dev/null so
    that the interpreter's final flush does not fail again (Python's documented way)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _setup_logging(getattr(args, "verbose", False))
        args.func(args)
        sys.stdout.flush()
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK if exc.code is None else EXIT_USAGE
    except BaseException as exc:  # noqa: B036 - the one place errors become exit codes
        if _leaf(exc, BrokenPipeError) is not None:
            # The reader went away, as `head` does: not an error (git and grep agree).
            _quiet_stdout()
            return EXIT_OK
        if _leaf(exc, KeyboardInterrupt) is not None:
            return EXIT_INTERRUPTED
        err = _leaf_error(exc)
        if isinstance(err, InternalError):  # a bug of ours: its traceback, for the report
            traceback.print_exception(err, file=sys.stderr)
            print(f"llmgw: internal error: {err}", file=sys.stderr)
            return err.exit_code
        if err is not None:
            print(f"llmgw: {err}", file=sys.stderr)
            return err.exit_code
        raise
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
