"""Parse argv lists with the installed SGLang's own server-args parser (ServerArgs.add_cli_args,
as `python -m sglang.launch_server` builds it). Reads a JSON list of argv lists on stdin,
prints per argv {"ok", "inexact": flags that are not exact option strings, "args"|"error"}.
Runs where `sglang` imports without a GPU: the vLLM venv's python, with sglang (--no-deps),
orjson and IPython on PYTHONPATH (see test_sglang_args.py)."""

import argparse
import json
import sys

from sglang.srt.server_args import ServerArgs

KEYS = ("model_path", "served_model_name", "host", "port", "tp_size", "nnodes", "node_rank",
        "dist_init_addr", "enable_lora", "lora_paths", "max_loras_per_batch", "max_lora_rank",
        "enable_metrics", "download_dir", "kv_events_config")


def main() -> None:
    out = []
    for argv in json.load(sys.stdin):
        p = argparse.ArgumentParser()
        ServerArgs.add_cli_args(p)
        known = {o for a in p._actions for o in a.option_strings}
        inexact = [t.split("=")[0] for t in argv if t.startswith("--") and t.split("=")[0] not in known]
        try:
            a = p.parse_args(argv)
        except SystemExit as exc:
            out.append({"ok": False, "inexact": inexact, "error": f"exit {exc.code}"})
            continue
        res = {"ok": True, "inexact": inexact, "args": {k: getattr(a, k, None) for k in KEYS}}
        if a.kv_events_config:
            # Through SGLang's own KVEventsConfig, as its EventPublisherFactory reads it.
            from sglang.srt.disaggregation.kv_events import KVEventsConfig

            res["kv_events"] = KVEventsConfig.from_cli(a.kv_events_config).model_dump()
        out.append(res)
    print(json.dumps(out, default=str))  # SGLang keeps --lora-paths as LoRARef objects


if __name__ == "__main__":
    main()
