"""Deployment files (conf/deployments/*.yaml) into Deployment, strictly.

Every mistake is a DeploymentError naming the file, the field and the value: an unknown
key, `gpus_per_node: 0`, an unknown engine, a negative replica count, a bad duration.
A deployment that no node fits today is still valid: the cluster may grow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml

from llmgw.config.duration import duration_from_value
from llmgw.errors import DeploymentError
from llmgw.model.deployment import Deployment, Strategy
from llmgw.model.engine import EngineKind

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
)
# A name ends up in replica ids, file names and log lines: keep it plain.
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
MAX_REPLICAS = 100_000


def load_deployment(path: str) -> Deployment:
    """Read and validate one deployment file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise DeploymentError(path, "", f"cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DeploymentError(path, "", f"not valid YAML: {exc}") from None
    return parse_deployment(data, path)


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
        try:
            timeout = duration_from_value(data["startup_timeout"])
        except ValueError as exc:
            raise DeploymentError(source, "startup_timeout", str(exc)) from None
        if timeout <= 0:
            raise err("startup_timeout", "expected a duration above zero such as 10m")
        kwargs["startup_timeout"] = timeout
    if "strategy" in data:
        try:
            kwargs["strategy"] = Strategy(data["strategy"])
        except ValueError:
            raise err("strategy", "expected spread or pack") from None
    return Deployment(
        name=name,
        model=model,
        engine=engine,
        gpus_per_node=gpus,
        replicas=replicas,
        **kwargs,
    )


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
