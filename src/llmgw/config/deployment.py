"""Deployment files (conf/deployments/*.yaml) into Deployment, strictly.

Every mistake is a DeploymentError naming the file, the field and the value: an unknown
key, `gpus_per_node: 0`, an unknown engine, a negative replica count, a bad duration.
A deployment that no node fits today is still valid: the cluster may grow.

This module is a function of data (the server's pure cores rebuild stored deployments
with it); reading a file is config/load_deployment.py's.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any

from llmgw.config.autoscale import parse_autoscale
from llmgw.config.duration import duration_from_value
from llmgw.errors import DeploymentError
from llmgw.model.deployment import Deployment, Strategy
from llmgw.model.engine import LORA_RANKS, Adapter, EngineKind

_REQUIRED = ("name", "model", "engine", "gpus_per_node", "replicas")
_OPTIONAL = (
    "served_name",
    "nodes",
    "gpu_memory_min",
    "selector",
    "args",
    "env",
    "startup_timeout",
    "strategy",
    "drain_timeout",
    "adapters",
    "max_loras",
    "max_lora_rank",
    "autoscale",
    "priority",
    "preflight",
    "preflight_timeout",
    "preflight_min_busbw",
    "asleep",
    "kv_events",
)
# A name ends up in replica ids, file names and log lines: keep it plain.
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
MAX_REPLICAS = 100_000
MAX_PRIORITY = 1_000_000


def parse_deployment(data: Any, source: str) -> Deployment:
    """Validate an already-parsed mapping; `source` names it in errors (file or "ctl")."""
    if not isinstance(data, Mapping):
        raise DeploymentError(source, "", f"expected a mapping of fields, got {_show(data)}")
    for key in data:
        if key not in _REQUIRED and key not in _OPTIONAL:
            known = ", ".join(_REQUIRED + _OPTIONAL)
            raise DeploymentError(source, str(key), f"unknown field (known: {known})")
    for key in _REQUIRED:
        if key not in data or data[key] is None:
            raise DeploymentError(source, key, "missing (required)")

    def err(key: str, message: str) -> DeploymentError:
        return DeploymentError(source, key, f"{message}, got {_show(data[key])}")

    name = data["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise err("name", "expected a lowercase name of letters, digits, '.', '_' or '-'")
    model = data["model"]
    if not isinstance(model, str) or not model.strip():
        raise err("model", "expected an org/name id or an absolute path")
    engine_raw = data["engine"]
    try:
        engine = EngineKind(engine_raw)
    except ValueError:
        kinds = ", ".join(k.value for k in EngineKind)
        raise err("engine", f"unknown engine (one of {kinds})") from None
    gpus = _int(data, "gpus_per_node", source, minimum=1)
    replicas = _int(data, "replicas", source, minimum=0)
    if replicas > MAX_REPLICAS:
        raise err("replicas", f"at most {MAX_REPLICAS}")
    kwargs: dict[str, Any] = {}
    if "served_name" in data:
        served = data["served_name"]
        if not isinstance(served, str) or not served:
            raise err("served_name", "expected a non-empty string")
        kwargs["served_name"] = served
    if "nodes" in data:
        kwargs["nodes"] = _int(data, "nodes", source, minimum=1)
    if "gpu_memory_min" in data:
        kwargs["gpu_memory_min"] = _int(data, "gpu_memory_min", source, minimum=0)
    if "selector" in data:
        kwargs["selector"] = _str_map(data, "selector", source)
    if "env" in data:
        kwargs["env"] = _str_map(data, "env", source)
    if "args" in data:
        args = data["args"]
        if not isinstance(args, list) or not all(
            isinstance(a, str | int | float) and not isinstance(a, bool) for a in args
        ):
            raise err("args", "expected a list of strings")
        kwargs["args"] = tuple(str(a) for a in args)
    if "startup_timeout" in data:
        kwargs["startup_timeout"] = _duration(data, "startup_timeout", source, zero=False,
                                              example="10m")
    if "drain_timeout" in data:
        kwargs["drain_timeout"] = _duration(data, "drain_timeout", source, zero=True,
                                            example="60s")
    if "strategy" in data:
        try:
            kwargs["strategy"] = Strategy(data["strategy"])
        except ValueError:
            raise err("strategy", "expected spread or pack") from None
    kwargs.update(_lora(data, source, model, kwargs.get("served_name", model)))
    kwargs.update(_preflight(data, source))
    if data.get("autoscale") is not None:
        auto = kwargs["autoscale"] = parse_autoscale(data["autoscale"], source)
        if not auto.min <= replicas <= auto.max:
            raise err("replicas", f"{replicas} is outside autoscale's min..max ({auto.min}..{auto.max}): "
                      "with autoscale, replicas is the count to start from")
        if auto.sleep_when_idle and engine is EngineKind.SGLANG:  # vLLM's (and its copy's)
            raise DeploymentError(source, "autoscale.sleep_when_idle", f"vLLM engines only, not {engine}")
    if "asleep" in data:  # the server's state (plain() carries it), like replicas
        if not isinstance(data["asleep"], bool):
            raise err("asleep", "expected true or false")
        if data["asleep"] and not (kwargs.get("autoscale") and kwargs["autoscale"].sleep_when_idle):
            raise err("asleep", "needs autoscale.sleep_when_idle")
        kwargs["asleep"] = data["asleep"]
    if "kv_events" in data:
        if not isinstance(data["kv_events"], bool):
            raise err("kv_events", "expected true or false")
        if data["kv_events"] and engine is EngineKind.SIMULATED:
            raise err("kv_events", "vLLM and SGLang engines only: the simulated engine publishes none")
        kwargs["kv_events"] = data["kv_events"]
    if "priority" in data:
        p = data["priority"]
        if isinstance(p, bool) or not isinstance(p, int) or not -MAX_PRIORITY <= p <= MAX_PRIORITY:
            raise err("priority", f"expected a whole number from {-MAX_PRIORITY} to {MAX_PRIORITY} "
                      f"(higher wins GPUs), got {p!r}")
        kwargs["priority"] = p
    return Deployment(
        name=name,
        model=model,
        engine=engine,
        gpus_per_node=gpus,
        replicas=replicas,
        **kwargs,
    )


def _preflight(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """preflight (required, best_effort, off), preflight_timeout (a duration above zero),
    preflight_min_busbw (GB/s, zero or more)."""
    out: dict[str, Any] = {}
    if "preflight" in data:
        mode = data["preflight"]
        # YAML 1.1 reads a bare `off` (and `no`) as false, `on` as true.
        if isinstance(mode, bool):
            mode = "required" if mode else "off"
        if mode not in PREFLIGHT_MODES:
            raise DeploymentError(source, "preflight", f"expected one of {', '.join(PREFLIGHT_MODES)}, "
                                  f"got {_show(mode)}")
        out["preflight"] = mode
    if "preflight_timeout" in data:
        out["preflight_timeout"] = _duration(data, "preflight_timeout", source, zero=False,
                                             example="60s")
    if "preflight_min_busbw" in data:
        v = data["preflight_min_busbw"]
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1e6:
            raise DeploymentError(source, "preflight_min_busbw", "expected GB/s of bus bandwidth, "
                                  f"zero or more, got {_show(v)}")
        out["preflight_min_busbw"] = float(v)
    return out


PREFLIGHT_MODES = ("required", "best_effort", "off")


def _duration(data: Mapping[str, Any], key: str, source: str, *, zero: bool, example: str) -> float:
    """data[key] as seconds: a duration such as 90s or 10m, above zero (or zero too)."""
    try:
        secs = duration_from_value(data[key])
    except ValueError as exc:
        raise DeploymentError(source, key, str(exc)) from None
    if secs < 0 or (secs == 0 and not zero):
        what = "of zero or more" if zero else "above zero"
        raise DeploymentError(source, key, f"expected a duration {what} such as {example}, "
                              f"got {_show(data[key])}")
    return secs


# An adapter's name is a `model` clients send, and vLLM's --lora-modules reads NAME=PATH.
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
MAX_ADAPTERS = 256
_ADAPTER_KEYS = ("name", "path")


def _lora(data: Mapping[str, Any], source: str, model: str, served: str) -> dict[str, Any]:
    """adapters, max_loras, max_lora_rank: a list of {name, path} with absolute paths and
    unique names, none of them the deployment's model or served name (a request naming
    it would be ambiguous); the limits as vLLM takes them."""
    out: dict[str, Any] = {}
    if "max_loras" in data:
        out["max_loras"] = _int(data, "max_loras", source, minimum=1)
    if "max_lora_rank" in data:
        rank = data["max_lora_rank"]
        if isinstance(rank, bool) or rank not in LORA_RANKS:
            ranks = ", ".join(str(r) for r in LORA_RANKS)
            raise DeploymentError(source, "max_lora_rank", f"expected one of {ranks}, got {_show(rank)}")
        out["max_lora_rank"] = rank
    raw = data.get("adapters")
    if raw is None:
        return out
    if not isinstance(raw, list):
        raise DeploymentError(source, "adapters", f"expected a list of {{name, path}}, got {_show(raw)}")
    if len(raw) > MAX_ADAPTERS:
        raise DeploymentError(source, "adapters", f"at most {MAX_ADAPTERS}, got {len(raw)}")
    adapters: list[Adapter] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        where = f"adapters[{i}]"
        if not isinstance(item, Mapping):
            raise DeploymentError(source, where, f"expected a mapping with name and path, got {_show(item)}")
        for key in item:
            if key not in _ADAPTER_KEYS:
                raise DeploymentError(source, f"{where}.{key}", "unknown field (known: name, path)")
        for key in _ADAPTER_KEYS:
            if item.get(key) is None:
                raise DeploymentError(source, f"{where}.{key}", "missing (required)")
        name, path = item["name"], item["path"]
        if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
            raise DeploymentError(source, f"{where}.name", "expected a name of letters, digits, '.', '_', "
                                  f"':', '/' or '-' (at most 200), got {_show(name)}")
        if name in seen:
            raise DeploymentError(source, f"{where}.name", f"{name!r} names two adapters")
        if name in (model, served):
            raise DeploymentError(source, f"{where}.name", f"{name!r} is the deployment's model or "
                                  "served name: a request for it could not tell which is meant")
        if not isinstance(path, str) or not posixpath.isabs(path) or "\0" in path:
            raise DeploymentError(source, f"{where}.path", f"expected an absolute path the nodes see, "
                                  f"got {_show(path)}")
        seen.add(name)
        adapters.append(Adapter(name, posixpath.normpath(path)))
    out["adapters"] = tuple(adapters)
    return out


def _int(data: Mapping[str, Any], key: str, source: str, *, minimum: int) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeploymentError(source, key, f"expected a whole number, got {_show(value)}")
    if value < minimum:
        what = "at least 1" if minimum == 1 else f"at least {minimum} (never negative)"
        raise DeploymentError(source, key, f"expected {what}, got {_show(value)}")
    return value


def _str_map(data: Mapping[str, Any], key: str, source: str) -> dict[str, str]:
    value = data[key]
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise DeploymentError(source, key, f"expected a mapping, got {_show(value)}")
    out: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or isinstance(v, bool | Mapping | list) or v is None:
            raise DeploymentError(
                source, f"{key}.{k}", f"expected a string value, got {_show(v)}"
            )
        out[k] = str(v)
    return out


def _show(value: object) -> str:
    if value is None:
        return "null (an empty value)"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
