"""Copies of weights the engine could not read, kept out until the scan says otherwise.

The storage scan counts a copy complete by its files (llmgw.agent.discovery.storage); an
engine may still fail to read one (a shard truncated by a copy that died, a header the
filer garbled). When an engine that was given a copy exits before it was ready, and its log
says its weights could not be read, the copy is marked here: every inventory then shows it
incomplete with the engine's words (so placement stops counting the node as a holder and
`describe node` says why), and weights_for never picks it again. The mark lasts while the
scan sees the same copy (same path, same size, complete); a scan that finds it changed (the
operator copied it again) or gone, or itself calls it incomplete, ends it.

Pure: data in, data out; the agent calls it from its event loop.
"""

from __future__ import annotations

from attrs import define, evolve, field

from llmgw.model.inventory import ModelCopy, StorageReport

# What the loaders print when the files are there but cannot be read, as seen in their
# sources: safetensors' Rust errors (vLLM and SGLang open weights with safe_open), torch's
# zip reader for .bin shards, transformers' and vLLM's "no weights / no config" messages.
UNREADABLE = (
    "SafetensorError",
    "Error while deserializing header",
    "incomplete metadata, file not fully covered",  # vLLM 0.32 on a truncated shard, seen
    "PytorchStreamReader failed",
    "invalid load key",
    "Cannot find any model weights",
    "does not appear to have a file named",
    "is not a valid JSON file",
)
PREFIX = "the engine could not read it: "
MAX_MARKS = 256  # bounded: a node holds at most a few hundred copies
REASON_CHARS = 200


def unreadable_reason(log_tail: tuple[str, ...] | list[str]) -> str:
    """The last line of an engine's log tail that says its weights could not be read, cut
    to REASON_CHARS; "" when none does."""
    for line in reversed(log_tail):
        if any(p in line for p in UNREADABLE):
            return line.strip()[-REASON_CHARS:]
    return ""


@define
class BadCopies:
    marks: dict[str, tuple[int, str]] = field(factory=dict)  # path -> (size when marked, why)

    def add(self, copy: ModelCopy, why: str) -> bool:
        """Mark `copy`; True when that is news."""
        mark = (copy.size, why)
        if self.marks.get(copy.path) == mark:
            return False
        if len(self.marks) >= MAX_MARKS and copy.path not in self.marks:
            self.marks.pop(next(iter(self.marks)))
        self.marks[copy.path] = mark
        return True

    def apply(self, storage: StorageReport) -> StorageReport:
        """`storage` with every marked copy shown incomplete, and the marks the scan
        contradicts (changed size, gone, incomplete by itself) dropped."""
        if not self.marks:
            return storage
        seen = {c.path: c for c in storage.models}
        for path, (size, _) in list(self.marks.items()):
            c = seen.get(path)
            # A copy shown incomplete by this very mark (an inventory marked before) is
            # no contradiction; the scan's own "incomplete" is.
            if c is None or c.size != size or not c.complete and not c.reason.startswith(PREFIX):
                del self.marks[path]
        if not self.marks:
            return storage
        models = tuple(
            evolve(c, complete=False, reason=PREFIX + self.marks[c.path][1])
            if c.path in self.marks else c
            for c in storage.models)
        return evolve(storage, models=models)
