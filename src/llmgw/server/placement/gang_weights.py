"""The copy of a gang's weights that every member holds complete, from their storage scans.

A multi-node vLLM replica under Ray runs `vllm serve <model>` on its head alone; the Ray
workers on every member open the path the head was given. The head's agent knows only its
own scan, so by itself it takes only a shared copy (a local path on the head may not exist
on the others). The server knows every member's scan: a path that each member's scan found
complete for the model can be given to the head, local or not, since every worker finds a
whole copy there (operators who rsync weights to /data/models on every node, or give each
node an NVMe with the same layout). For a Hugging Face cache copy the path is the
snapshot's, so the same path is the same revision.

Pure: the model and the members' last StorageReports in, a path or "" out. The agent
checks the path against its own scan before it uses it (agent/engines/weights.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.model.inventory import ModelCopy, StorageReport, names_a_path


def _complete(model: str, storage: StorageReport) -> dict[str, ModelCopy]:
    """Path (no trailing slash) -> the complete copy of `model` the scan found there."""
    out: dict[str, ModelCopy] = {}
    for c in storage.models:
        if c.complete and c.name == model:
            out.setdefault(c.path.rstrip("/"), c)
    return out


def gang_weights_path(model: str, members: Sequence[StorageReport | None]) -> str:
    """The path at which every member (head first) holds a complete copy of `model`; "" if
    none, if a member has no scan (None, or `model_dirs` unset), or if `model` is itself a
    path (the engine takes it as written).

    Of several such paths: those local on every member first (a local disk reads faster
    than a filer), then by how few members see it on shared storage, then in the head's
    scan order (the operator's model_dirs order)."""
    if not members or names_a_path(model):
        return ""
    held: list[dict[str, ModelCopy]] = []
    for storage in members:
        if storage is None or not storage.asked:
            return ""
        held.append(_complete(model, storage))
    head = held[0]
    common = [p for p in head if all(p in h for h in held[1:])]
    if not common:
        return ""
    order = {p: i for i, p in enumerate(head)}
    common.sort(key=lambda p: (sum(h[p].shared for h in held), order[p]))
    return common[0]
