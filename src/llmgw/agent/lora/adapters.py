"""LoRA adapters on a running engine: what to load and unload, from what it says it has.

Pure: data in, data out. The trio shell (adapter_sync.py) asks the engine's GET /v1/models,
feeds the answer through `loaded_adapters`, carries out `adapter_actions` with vLLM's
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
{"lora_name"} (vllm 0.32 entrypoints/serve/lora/api_router.py, protocol.py), and reads
each answer with `answer_error`. Level-triggered: asking the engine each time, rather
than remembering what was sent, makes an agent restart, an engine that lost an adapter
or a load that half-happened all converge the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from attrs import frozen

from llmgw.model.engine import Adapter

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
MODELS_PATH = "/v1/models"
# An engine's error text kept in a report: enough for "No adapter found for /path".
ERROR_CHARS = 300


@frozen
class Load:
    name: str
    path: str

    def request(self) -> tuple[str, dict[str, Any]]:
        return LOAD_PATH, {"lora_name": self.name, "lora_path": self.path}


@frozen
class Unload:
    name: str

    def request(self) -> tuple[str, dict[str, Any]]:
        return UNLOAD_PATH, {"lora_name": self.name}


AdapterAction = Load | Unload


def adapter_actions(wanted: tuple[Adapter, ...], loaded: Mapping[str, str]) -> tuple[AdapterAction, ...]:
    """What turns `loaded` (name -> path, as the engine lists them) into `wanted`.

    Unloads first, by name (they free the engine's slots a load may need); a wanted name
    loaded from another path is unloaded and loaded again (vLLM refuses a second load of
    one name unless in place, and in place keeps the old weights' prefix cache). Loads in
    the deployment's order."""
    want = {a.name: a.path for a in wanted}
    unloads = [Unload(n) for n in sorted(loaded) if want.get(n) != loaded[n]]
    loads = [Load(a.name, a.path) for a in wanted if loaded.get(a.name) != a.path]
    return (*unloads, *loads)


def loaded_adapters(body: bytes, served_name: str) -> dict[str, str]:
    """name -> path of the adapters in a /v1/models answer: vLLM lists each loaded one as
    a model card whose `parent` is its base and whose `root` is the path it was loaded
    from (OpenAIServingModels.show_available_models); the base itself has no parent.
    Raises ValueError on an answer that is not that list."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"/v1/models is not JSON: {exc}") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models has no list of models")
    out: dict[str, str] = {}
    for card in data:
        if not isinstance(card, dict):
            continue
        name, parent, root = card.get("id"), card.get("parent"), card.get("root")
        if isinstance(name, str) and parent and name != served_name:
            out[name] = root if isinstance(root, str) else ""
    return out


def answer_error(status: int, body: bytes) -> str:
    """"" for a 200; else the engine's own message (vLLM's ErrorResponse
    {"error": {"message", "type", "code"}}), or the status and the start of the body."""
    if status == 200:
        return ""
    message = _error_message(body)
    if message:
        return f"{message[:ERROR_CHARS]} (HTTP {status})"
    # Not vLLM's error shape: the raw answer says what came back.
    text = body[:ERROR_CHARS].decode("utf-8", "replace").strip()
    return f"HTTP {status}" + (f": {text}" if text else "")


def _error_message(body: bytes) -> str:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    err = doc.get("error") if isinstance(doc, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    return message if isinstance(message, str) else ""


@frozen
class SyncResult:
    """After one sync: the adapters the engine has loaded, and each one it would not."""

    loaded: tuple[str, ...]
    errors: tuple[str, ...]  # "name: why"


def after(loaded: Mapping[str, str], done: Mapping[AdapterAction, str],
          wanted: tuple[Adapter, ...]) -> SyncResult:
    """What the engine has once `done` (action -> "" or its error) was carried out on
    `loaded`: the wanted ones first, in the deployment's order."""
    have = dict(loaded)
    errors: list[str] = []
    for action, err in done.items():
        if isinstance(action, Unload):
            if not err or "cannot be found" in err:  # gone either way
                have.pop(action.name, None)
            else:
                errors.append(f"{action.name}: unload failed: {err}")
        elif err:
            errors.append(f"{action.name}: {err}")
            have.pop(action.name, None)
        else:
            have[action.name] = action.path
    order = [a.name for a in wanted if a.name in have]
    order += sorted(n for n in have if n not in order)
    return SyncResult(tuple(order), tuple(errors))
