"""Parse argv lists with the installed vLLM's own `vllm serve` argument parser.

Run with the vLLM venv's python: reads a JSON list of argv lists (each starting with
"serve", the binary left off) on stdin; prints a JSON list with, per argv, either
{"ok": true, "args": {...}} (the parsed values of the flags llmgw sets) or
{"ok": false, "error": "..."}. Builds the parser exactly as `vllm`'s main() does and runs
the serve subcommand's own validation, so a renamed or removed flag is an error here.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

KEYS = ("model_tag", "host", "port", "served_model_name", "tensor_parallel_size",
        "pipeline_parallel_size", "distributed_executor_backend", "nnodes", "node_rank",
        "master_addr", "master_port", "headless", "max_model_len", "enforce_eager")


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
        except SystemExit as exc:
            out.append({"ok": False, "error": f"exit {exc.code}: {err.getvalue().strip()[-2000:]}"})
            continue
        except Exception as exc:  # validation errors
            out.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        out.append({"ok": True, "args": {k: getattr(args, k, None) for k in KEYS}})
    json.dump(out, sys.stdout, default=str)


if __name__ == "__main__":
    main()
