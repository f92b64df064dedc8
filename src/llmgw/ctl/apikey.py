"""`llmgw ctl apikey create|list|describe|update|revoke|import` (API keys and limits).

The secret is made here and printed once; the server gets its SHA-256 and its first
characters (to name it in listings), never the secret. What the operator typed wrong
(a budget, a date, a file) is said in one line before anything is sent (exit 2).
"""

from __future__ import annotations

import argparse
import datetime
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

from llmgw.config.duration import parse_duration
from llmgw.ctl.render import table
from llmgw.errors import ConfigError, UsageError
from llmgw.model.apikey import SECRET_BYTES, SHOWN, Budget, check_class, check_name, hash_secret, make_secret
from llmgw.router.tenants.auth import parse_keys
from llmgw.transport.apikey_ops import (
    ApiKeyCreateOp,
    ApiKeyImportOp,
    ApiKeyListOp,
    ApiKeyRevokeOp,
    ApiKeyUpdateOp,
)

VERBS = ("create", "list", "describe", "update", "revoke", "import")
_TOKENS = re.compile(r"^(\d+)([kKmM]?)$")
_DAYS = re.compile(r"^(\d+(?:\.\d+)?)([dw])$")


def add_arguments(cmd: Callable[[str, str], argparse.ArgumentParser],
                  common: Callable[[argparse.ArgumentParser], None],
                  parser_class: type[argparse.ArgumentParser]) -> None:
    p = cmd("apikey", "API keys of the routers' clients, kept by the server")
    sub = p.add_subparsers(dest="apikey_cmd", metavar="VERB", parser_class=parser_class)
    p.set_defaults(apikey_cmd=None, apikey_help=p)

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        v = sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".")
        common(v)
        return v

    def limits(v: argparse.ArgumentParser) -> None:
        v.add_argument("--models", metavar="M,...",
                       help="the models (served names or adapters) it may use; '*': every one")
        for flag, what in (("--rpm", "requests per minute"), ("--tpm", "tokens per minute"),
                           ("--concurrency", "requests at once")):
            v.add_argument(flag, type=int, metavar="N", help=f"at most N {what} (0: no limit)")
        v.add_argument("--budget", metavar="TOKENS/PERIOD",
                       help="at most TOKENS (prompt and completion) per PERIOD, e.g. 5M/30d "
                            "or 20000/1h (none: no budget)")
        v.add_argument("--on-server-loss", choices=("allow", "deny", "default"),
                       help="once a router's leases are spent and the server does not answer: "
                            "admit, refuse, or the default (budgets refuse, rate limits admit)")
        v.add_argument("--class", dest="priority_class", metavar="CLASS",
                       help="its priority class, one of the routers' classes (default: the "
                            "routers' default_class); a request may lower it, never raise it")
        v.add_argument("--expires", metavar="DATE",
                       help="when it stops working: 2027-01-31 (00:00 UTC) or an ISO time "
                            "(never: it does not)")

    c = verb("create", "a new key; its secret is printed once")
    c.add_argument("name", metavar="NAME", help="the key's name (its owner, a team)")
    limits(c)
    verb("list", "every key (names, prefixes, state and limits; never the secrets)")
    verb("describe", "one key in full").add_argument("name", metavar="NAME")
    u = verb("update", "change a key's models, limits or expiry (what is given)")
    u.add_argument("name", metavar="NAME")
    limits(u)
    verb("revoke", "refuse a key everywhere (within a router's key table interval)").add_argument(
        "name", metavar="NAME")
    verb("import", "move the keys of a router's api_keys_file into the server (hashes, "
         "names and models)").add_argument("file", metavar="FILE")


def parse_budget(text: str) -> Budget:
    tokens, sep, period = text.partition("/")
    m = _TOKENS.match(tokens.strip())
    if not sep or m is None:
        raise UsageError(f"--budget: expected TOKENS/PERIOD such as 5M/30d or 20000/1h, got {text!r}")
    n = int(m.group(1)) * {"": 1, "k": 1000, "m": 1_000_000}[m.group(2).lower()]
    try:
        seconds = period_seconds(period)
    except ValueError:
        raise UsageError(f"--budget: {period!r} is not a period (30d, 1w, 12h, 90m)") from None
    if n < 1 or seconds < 1:
        raise UsageError(f"--budget: expected at least 1 token per 1 s, got {text!r}")
    return Budget(n, seconds)


def period_seconds(text: str) -> float:
    """A duration (90m, 12h) or days and weeks (30d, 1w). Raises ValueError."""
    d = _DAYS.match(text.strip())
    if d:
        return float(d.group(1)) * (86400 if d.group(2) == "d" else 7 * 86400)
    return parse_duration(text.strip())


def parse_expires(text: str, now: float) -> float:
    """Epoch seconds; 0 for "never". A date without a time is 00:00 UTC, a time without a
    zone is UTC."""
    if text.strip().lower() == "never":
        return 0.0
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(f"--expires: expected a date (2027-01-31), an ISO time or never, "
                         f"got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    ts = when.timestamp()
    if ts <= now:
        raise UsageError(f"--expires: {text} is in the past")
    return ts


def _models(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(sorted({m.strip() for m in text.split(",") if m.strip()}))
    return () if "*" in names else names


def op_of(args: argparse.Namespace, now: float | None = None) -> Any:
    """The request; for `create`, args.secret is set to the new secret (printed once)."""
    now = time.time() if now is None else now
    v = args.apikey_cmd
    if v is None:
        raise UsageError("ctl apikey: expected a verb: " + ", ".join(VERBS))
    if v in ("create", "update", "describe", "revoke"):
        why = check_name(args.name)
        if why:
            raise UsageError(f"ctl apikey {v}: {why}")
    if v == "list":
        return ApiKeyListOp()
    if v == "describe":
        return ApiKeyListOp(args.name)
    if v == "revoke":
        return ApiKeyRevokeOp(args.name)
    if v == "import":
        return ApiKeyImportOp(import_file(args.file))
    budget = parse_budget(args.budget) if args.budget and args.budget.lower() != "none" else None
    expires = parse_expires(args.expires, now) if args.expires is not None else None
    for flag in ("rpm", "tpm", "concurrency"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise UsageError(f"--{flag}: expected 0 (no limit) or more, got {value}")
    loss = None if args.on_server_loss is None else \
        "" if args.on_server_loss == "default" else args.on_server_loss
    klass = None if args.priority_class is None else \
        "" if args.priority_class == "default" else args.priority_class
    if klass and check_class(klass):
        raise UsageError(f"--class: {check_class(klass)}")
    if v == "create":
        secret = make_secret(secrets.token_bytes(SECRET_BYTES))
        args.secret = secret
        return ApiKeyCreateOp(args.name, hash_secret(secret), secret[:SHOWN],
                              models=_models(args.models) or (), rpm=args.rpm or 0,
                              tpm=args.tpm or 0, concurrency=args.concurrency or 0,
                              budget=budget, expires=expires or 0.0, on_server_loss=loss or "",
                              priority_class=klass or "")
    return ApiKeyUpdateOp(args.name, models=_models(args.models), rpm=args.rpm, tpm=args.tpm,
                          concurrency=args.concurrency, budget=budget,
                          clear_budget=bool(args.budget) and args.budget.lower() == "none",
                          expires=expires, on_server_loss=loss, priority_class=klass)


def import_file(path: str) -> tuple[ApiKeyCreateOp, ...]:
    try:
        with open(path, encoding="utf-8") as f:
            keys = parse_keys(f.read(), path)
    except OSError as exc:
        raise UsageError(f"ctl apikey import: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"ctl apikey import: {path} is not UTF-8 text") from None
    except ConfigError as exc:
        raise UsageError(f"ctl apikey import: {exc}") from None
    out = []
    for digest, k in sorted(keys.items(), key=lambda kv: kv[1].name):
        why = check_name(k.name)
        if why:
            raise UsageError(f"ctl apikey import: {path}: key {k.name!r}: {why}")
        out.append(ApiKeyCreateOp(k.name, digest.lower(),
                                  models=tuple(sorted(k.models)) if k.models is not None else (),
                                  priority_class=k.priority_class))
    return tuple(out)


def _when(ts: float) -> str:
    if not ts:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M")


def _limit(n: int) -> str:
    return str(n) if n else "-"


def _budget(b: dict[str, Any] | None) -> str:
    if not b:
        return "-"
    period = float(b["period"])
    p = f"{period / 86400:g}d" if period >= 86400 else f"{period / 3600:g}h" if period >= 3600 \
        else f"{period:g}s"
    return f"{b['tokens']}/{p}"


def render(args: argparse.Namespace, result: Any) -> str:
    v = args.apikey_cmd
    if v == "import":
        names = result.get("imported", [])
        return f"imported {len(names)} API keys" + (": " + ", ".join(names) if names else "")
    if v == "list":
        return table(["NAME", "PREFIX", "STATE", "MODELS", "RPM", "TPM", "CONCURRENCY", "BUDGET",
                      "EXPIRES"],
                     [[k["name"], k["prefix"] or "(imported)", k["state"],
                       ",".join(k["models"]) or "*", _limit(k["rpm"]), _limit(k["tpm"]),
                       _limit(k["concurrency"]), _budget(k["budget"]), _when(k["expires"])]
                      for k in result])
    k = result
    lines = [f"name:         {k['name']}",
             f"prefix:       {k['prefix'] or '(imported: its secret was never seen here)'}",
             f"state:        {k['state']}",
             f"models:       {', '.join(k['models']) or '* (every model)'}",
             f"rpm:          {_limit(k['rpm'])}",
             f"tpm:          {_limit(k['tpm'])}",
             f"concurrency:  {_limit(k['concurrency'])}",
             f"budget:       {_budget(k['budget'])}",
             f"expires:      {_when(k['expires'])}",
             f"on loss:      {k.get('on_server_loss', 'default')} (the server unreachable, "
             "leases spent)",
             f"class:        {k.get('priority_class', 'default')}",
             f"created:      {_when(k['created'])}"]
    if k["revoked"]:
        lines.append(f"revoked:      {_when(k['revoked'])}")
    if v == "create":
        lines = [f"API key {k['name']} created. Its secret, shown only now (keep it safe):",
                 "", f"    {args.secret}", "", *lines]
    return "\n".join(lines)


def plain(args: argparse.Namespace, result: Any) -> Any:
    """For -o json|yaml: the result, with the new secret in a create's."""
    if args.apikey_cmd == "create":
        return {"secret": args.secret, **result}
    return result
