"""Which weights an engine loads: a copy this node holds, or a download into download_dir.

Pure: the node's last storage scan (StorageReport) in, `Weights` out. The launch plans put
`Weights.arg` where the engine takes its model and `Weights.env` in its environment; the
served name stays the deployment's (`--served-model-name`), so clients see no difference.

- A complete plain tree (`<model_dir>/org/name/config.json ...`): its path.
- A complete Hugging Face cache copy (`<cache>/models--org--name/snapshots/<rev>`): the
  snapshot's path, with HF_HUB_CACHE=<cache> and HF_HUB_OFFLINE=1. The snapshot path rather
  than the id: it is the very revision the scan checked complete (the scan takes refs/main's
  snapshot, else the newest), and both loaders take a directory as local without asking the
  hub (vLLM 0.32's DefaultModelLoader: `is_local = os.path.isdir(model)`, no
  snapshot_download; SGLang's loader the same for --model-path). The id under
  HF_HUB_OFFLINE=1 instead goes through huggingface_hub's refs/<revision> lookup, which
  fails on a cache without refs/main that the scan still counts complete. The cache and
  offline variables keep anything else the engine looks up by id (a tokenizer named in the
  args) in the same cache and off the network; a deployment's own env still wins.
- No complete copy: the id as written, and the engine downloads into `download_dir`
  (HF_HUB_CACHE, and `--download-dir` for vLLM and SGLang), a cache layout the next scan reads, so the
  node holds the model from then on; a half-written download is never complete there.
- An absolute path the deployment names: as written (the operator chose it).
- A Ray gang (its workers open the head's path on every member): a shared copy, or a local
  one at the path the server saw every member hold complete (GangSpec.weights_path), once
  this node's own scan confirms it complete there.
"""

from __future__ import annotations

import posixpath

from attrs import field, frozen

from llmgw.config.agent import AgentConfig
from llmgw.errors import EngineError
from llmgw.model.engine import EngineKind, EngineSpec
from llmgw.model.inventory import ModelCopy, StorageReport, names_a_path

HF_CACHE_ENV = "HF_HUB_CACHE"
HF_OFFLINE_ENV = "HF_HUB_OFFLINE"
HF_REPO_PREFIX = "models--"


@frozen
class Weights:
    """What the engine is given for its model, and why."""

    arg: str  # the engine's model argument: a path, or the id as the deployment wrote it
    env: dict[str, str] = field(factory=dict)  # HF_HUB_CACHE / HF_HUB_OFFLINE, when set
    copy: ModelCopy | None = None  # the copy used; None: downloading, or a path as written
    reason: str = ""  # one line, for the engine's log, its record and `describe replica`
    # Where the engine downloads to ("" when it uses a copy or has nowhere named):
    # vLLM's and SGLang's --download-dir.
    download_dir: str = ""


def hf_cache_of(path: str) -> str:
    """The cache folder of a snapshot path `<cache>/models--o--n/snapshots/<rev>`, else ""."""
    snaps = posixpath.dirname(path.rstrip("/"))
    repo = posixpath.dirname(snaps)
    if posixpath.basename(snaps) != "snapshots" or not posixpath.basename(repo).startswith(HF_REPO_PREFIX):
        return ""
    return posixpath.dirname(repo)


def describe_copy(copy: ModelCopy) -> str:
    """'local plain tree /data/org/x' / 'shared HF cache /mnt/... (store weka-a)'."""
    layout = "HF cache" if hf_cache_of(copy.path) else "plain tree"
    where = f"shared {layout} {copy.path}" if copy.shared else f"local {layout} {copy.path}"
    return where + (f" (store {copy.store})" if copy.shared and copy.store else "")


def resolve_weights(
    model: str,
    storage: StorageReport | None,
    download_dir: str,
    *,
    shared_only: bool = False,
    gang_path: str = "",
    need_bytes: int = 0,
    free_bytes: int | None = None,
) -> Weights:
    """The weights for `model` (an id or a path) on a node whose last scan is `storage`.

    Complete copies are taken local first (a local disk reads faster than a filer), then
    in scan order (the operator's model_dirs order). `shared_only`: only a shared copy may
    be used (a Ray gang: its head's argv is what every member opens), or the copy at
    `gang_path`, the path the server saw every member of the gang hold complete
    (GangSpec.weights_path), where this node's own scan holds it complete too; where it
    does not, the rule above, and the reason says why. A download whose size is known
    (`need_bytes` > 0) into a `download_dir` with `free_bytes` less than that raises
    EngineError with the reason; unknown size or free space: not checked.
    """
    copies = storage.models if storage is not None else ()
    if names_a_path(model):
        held = next((c for c in copies if c.path.rstrip("/") == model.rstrip("/")), None)
        why = f"{model}: the path the deployment names" + (
            f" ({describe_copy(held)})" if held is not None else "")
        return Weights(arg=model, copy=held, reason=why)
    named = [c for c in copies if c.name == model]
    note = ""  # why the gang's common copy is not used, when there was one
    if shared_only and gang_path:
        here = next((c for c in named if c.path.rstrip("/") == gang_path.rstrip("/")), None)
        if here is not None and here.complete:
            return _use(model, here, ", held complete by every member of the gang")
        note = (f"the copy every member of the gang held at {gang_path} is "
                + (f"incomplete here ({here.reason})" if here is not None else "not in this node's scan"))
    usable = [c for c in named if c.complete and (c.shared or not shared_only)]
    usable.sort(key=lambda c: c.shared)  # stable: local first, then scan order
    if usable:
        return _use(model, usable[0], f" ({note})" if note else "")
    incomplete = [c for c in named if not c.complete]
    local_held = [c for c in named if c.complete and not c.shared]
    if note:
        why = f"{model}: {note}"
    elif local_held:
        why = (f"{model}: the local copy {local_held[0].path} is not used (a Ray gang's members "
               "open the head's path; only a shared copy, or a path every member holds "
               "complete, qualifies)")
    elif incomplete:
        why = f"{model}: the copy at {incomplete[0].path} is incomplete ({incomplete[0].reason})"
    else:
        why = f"{model}: no copy on this node"
    if not download_dir:
        return Weights(arg=model, reason=why + "; the engine fetches it into its own cache "
                       "(no download_dir: set one so the scan sees the copy)")
    if need_bytes > 0 and free_bytes is not None and free_bytes < need_bytes:
        raise EngineError(
            f"{why}, and download_dir {download_dir} has {_gib(free_bytes)} free for its "
            f"{_gib(need_bytes)}")
    return Weights(arg=model, env={HF_CACHE_ENV: download_dir}, reason=f"{why}; downloading into "
                   f"{download_dir}", download_dir=download_dir)


def _use(model: str, copy: ModelCopy, why: str) -> Weights:
    cache = hf_cache_of(copy.path)
    env = {HF_CACHE_ENV: cache, HF_OFFLINE_ENV: "1"} if cache else {}
    return Weights(arg=copy.path, env=env, copy=copy, reason=f"{model}: {describe_copy(copy)}{why}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def download_dir_of(config: AgentConfig) -> str:
    """agent.yaml's download_dir; unset (None): the first model_dirs entry (the loader has
    already put the first writable one there when it read a file); "" or no model_dirs:
    none."""
    if config.download_dir is not None:
        return config.download_dir
    return config.model_dirs[0].path if config.model_dirs else ""


def weights_for(spec: EngineSpec, config: AgentConfig, storage: StorageReport | None) -> Weights:
    """resolve_weights for one engine spec on this node.

    A multi-node Ray replica takes only a shared copy, or the path the server saw every
    member hold complete (GangSpec.weights_path): `vllm serve` runs on the head alone and
    its Ray workers open the path it was given, which a local copy on the head alone is
    not on the others. The simulated engine takes the same answer, so dev shows what a
    real engine would get.
    """
    gang = spec.gang
    ray = (spec.engine is EngineKind.VLLM and gang is not None and gang.nnodes > 1
           and config.engines.vllm.launch_mode == "ray")
    return resolve_weights(spec.model, storage, download_dir_of(config), shared_only=ray,
                           gang_path=gang.weights_path if ray and gang is not None else "")
