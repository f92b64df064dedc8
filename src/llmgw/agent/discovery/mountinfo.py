"""Pure parsing of /proc/self/mountinfo: which mount covers a path, shared or local.

Shared means a network or cluster filesystem, identified by the mount's source so every
node that mounts the same filer names it the same. Anything else, or anything unsure,
is local: local read as shared would have the cluster believe a model is everywhere.
"""

from __future__ import annotations

import logging
import posixpath
import re

from attrs import frozen

log = logging.getLogger(__name__)

SHARED_FSTYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "cephfs",
        "glusterfs",
        "cifs",
        "smb3",
    }
)
# fuse.<subtype> mounts of the same filesystems (client names as they show in mountinfo).
SHARED_FUSE = frozenset({"glusterfs", "ceph-fuse", "ceph", "cephfs", "beegfs", "lustre"})

_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    """Undo the kernel's octal escapes: `\\040` space, `\\011` tab, `\\012`, `\\134`."""
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), field)


@frozen
class Mount:
    mount_id: int
    parent_id: int
    root: str  # the part of the source filesystem mounted here (bind mounts: not "/")
    mount_point: str
    fstype: str
    source: str


def parse_mountinfo(text: str) -> list[Mount]:
    """Every well-formed line; a malformed one is logged and skipped."""
    mounts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            mounts.append(
                Mount(
                    mount_id=int(fields[0]),
                    parent_id=int(fields[1]),
                    root=unescape(fields[3]),
                    mount_point=unescape(fields[4]),
                    fstype=fields[sep + 1],
                    source=unescape(fields[sep + 2]) if len(fields) > sep + 2 else "",
                )
            )
        except (ValueError, IndexError):
            log.warning("skipping malformed mountinfo line: %r", line)
    return mounts


def _covers(mount_point: str, path: str) -> bool:
    if mount_point == "/":
        return True
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def covering_mount(mounts: list[Mount], path: str) -> Mount | None:
    """The mount `path` lives on: the longest covering mount point; the later one wins a
    tie (a mount over a mount point hides the earlier one). `path` should be resolved."""
    path = posixpath.normpath(path)
    best: Mount | None = None
    for m in mounts:
        if _covers(m.mount_point, path) and (best is None or len(m.mount_point) >= len(best.mount_point)):
            best = m
    return best


def is_shared_fstype(fstype: str) -> bool:
    fstype = fstype.lower()
    if fstype in SHARED_FSTYPES:
        return True
    if fstype.startswith("fuse."):
        return fstype[len("fuse.") :] in SHARED_FUSE
    return False


def classify(mounts: list[Mount], path: str) -> tuple[bool, str]:
    """(shared, store) for `path`. Local (False, "") unless surely a shared filesystem."""
    m = covering_mount(mounts, path)
    if m is None or not is_shared_fstype(m.fstype) or not m.source or m.source == "none":
        return False, ""
    return True, store_identity(m)


def store_identity(m: Mount) -> str:
    """The filer's name, the same on every node: the mount source (`host:/export`,
    `mgs@o2ib:/fs`). Sources naming no server (`beegfs_nodev`, `ceph-fuse`, a GPFS device)
    say nothing of which filer; the mount point is added, as clusters mount alike."""
    if ":" in m.source or "@" in m.source:
        return m.source
    return f"{m.source}:{m.mount_point}"
