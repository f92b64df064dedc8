"""Shared or local, from /proc/self/mountinfo samples."""

from __future__ import annotations

import pytest

from llmgw.agent.discovery.mountinfo import (
    classify,
    covering_mount,
    is_shared_fstype,
    parse_mountinfo,
    unescape,
)

SAMPLE = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
25 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
30 22 0:25 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw
41 22 259:5 / /data rw,noatime shared:20 - xfs /dev/nvme1n1 rw,attr2,inode64
60 22 0:50 / /mnt/models rw,relatime shared:30 - nfs4 10.0.0.5:/export/models rw,vers=4.2
61 22 0:51 / /lustre rw,relatime shared:31 - lustre 172.16.0.1@o2ib:/lfs rw,flock
62 61 259:9 / /lustre/scratch/local rw,relatime shared:32 - ext4 /dev/nvme2n1 rw
63 22 0:52 / /mnt/beegfs rw,relatime shared:33 - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf
64 22 0:53 / /mnt/ceph rw,relatime shared:34 - ceph 10.0.0.7:6789,10.0.0.8:6789:/models rw,name=llmgw
65 22 0:54 / /mnt/gluster rw,relatime shared:35 - fuse.glusterfs gfs1:/models rw,user_id=0
66 22 0:55 / /mnt/cephfuse rw,relatime shared:36 - fuse.ceph-fuse ceph-fuse rw,user_id=0
67 22 0:56 / /mnt/sshfs rw,relatime shared:37 - fuse.sshfs me@host:/models rw,user_id=0
68 22 259:12 / /mnt/nvmeof rw,relatime shared:38 - xfs /dev/nvme5n1 rw
69 22 0:50 /llama /srv/llama rw,relatime shared:30 - nfs4 10.0.0.5:/export/models rw,vers=4.2
70 22 259:2 /var/lib/models /models rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
71 22 0:57 / /mnt/model\\040store rw,relatime shared:39 - nfs 10.0.0.9:/vol\\040a rw
72 22 0:58 / /var/lib/containers/overlay rw shared:40 - overlay overlay rw,lowerdir=/a
"""
MOUNTS = parse_mountinfo(SAMPLE)


def test_parse_fields_and_octal_escapes() -> None:
    m = {x.mount_point: x for x in MOUNTS}
    nfs = m["/mnt/models"]
    assert (nfs.mount_id, nfs.parent_id, nfs.fstype) == (60, 22, "nfs4")
    assert nfs.source == "10.0.0.5:/export/models"
    spaced = m["/mnt/model store"]
    assert spaced.source == "10.0.0.9:/vol a"
    assert m["/srv/llama"].root == "/llama"
    assert unescape("a\\011b\\134c\\012") == "a\tb\\c\n"


def test_malformed_lines_are_skipped() -> None:
    assert parse_mountinfo("garbage\n" + SAMPLE.splitlines()[0] + "\n")[0].mount_id == 22


@pytest.mark.parametrize(
    ("path", "shared", "store"),
    [
        ("/mnt/models/meta-llama/Llama-3.1-8B", True, "10.0.0.5:/export/models"),
        ("/lustre/models/qwen", True, "172.16.0.1@o2ib:/lfs"),
        ("/mnt/beegfs/models", True, "beegfs_nodev:/mnt/beegfs"),
        ("/mnt/ceph/x", True, "10.0.0.7:6789,10.0.0.8:6789:/models"),
        ("/mnt/gluster/x", True, "gfs1:/models"),
        ("/mnt/cephfuse/x", True, "ceph-fuse:/mnt/cephfuse"),
        ("/mnt/model store/x", True, "10.0.0.9:/vol a"),
        # bind mount of the NFS export: the filer is still the filer
        ("/srv/llama/8b", True, "10.0.0.5:/export/models"),
        # local
        ("/data/models", False, ""),
        ("/dev/shm/m", False, ""),
        ("/mnt/nvmeof/models", False, ""),  # xfs on an NVMe-oF block device
        ("/models", False, ""),  # bind mount of a local directory
        ("/mnt/sshfs/x", False, ""),  # a fuse mount of unknown kind: in doubt, local
        ("/var/lib/containers/overlay/m", False, ""),
        ("/home/me/models", False, ""),
        ("/mnt/modelsX", False, ""),  # a prefix of a mount point is not under it
    ],
)
def test_shared_or_local(path: str, shared: bool, store: str) -> None:
    assert classify(MOUNTS, path) == (shared, store)


def test_nested_mount_longest_wins() -> None:
    # ext4 mounted inside the lustre tree: local, though its parent is shared
    assert classify(MOUNTS, "/lustre/scratch/local/m") == (False, "")
    m = covering_mount(MOUNTS, "/lustre/scratch/local/m")
    assert m is not None and m.mount_id == 62


def test_mount_over_a_mount_point_hides_the_earlier() -> None:
    over = SAMPLE + "80 41 0:60 / /data rw - nfs 10.0.0.5:/data rw\n"
    assert classify(parse_mountinfo(over), "/data/m") == (True, "10.0.0.5:/data")


def test_no_mounts_is_local() -> None:
    assert classify([], "/mnt/models") == (False, "")


def test_shared_fstypes() -> None:
    for t in ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "glusterfs", "cifs", "smb3"):
        assert is_shared_fstype(t), t
    for t in ("fuse.glusterfs", "fuse.ceph-fuse", "fuse.beegfs"):
        assert is_shared_fstype(t), t
    for t in ("ext4", "xfs", "btrfs", "zfs", "tmpfs", "overlay", "fuse", "fuse.sshfs", "9p"):
        assert not is_shared_fstype(t), t
