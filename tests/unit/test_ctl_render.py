"""ctl's tables: narrow by default, more columns with -o wide, describe node|replica."""

from __future__ import annotations

from llmgw.ctl.render import render

REPLICA = {"id": "d-0", "deployment": "d", "state": "ready", "generation": 3, "nodes": ["n1"],
           "gpus": [0, 1], "endpoint": "http://10.0.0.1:20000", "fabric": "ib-a", "restarts": 2,
           "reason": ""}
NODE = {"id": "n1", "state": "ready", "cordoned": True, "draining": False, "heartbeat_age": 1.0,
        "connected": True, "mgmt_addr": "10.0.0.1", "labels": {"rack": "r1"},
        "fabrics": [{"name": "ib-a", "state": "up", "hcas": ["mlx5_0"]}],
        "gpus": [{"index": 0, "name": "H100", "memory_total": 81920, "memory_free": 40960,
                  "numa_node": 0, "nvlink_peers": {"1": 18}}],
        "gpu_source": "nvml", "storage": {"asked": False}, "warnings": []}


def test_get_replicas_narrow_and_wide() -> None:
    narrow = render("get", "replica", [REPLICA])
    assert narrow.splitlines()[0].split() == ["ID", "DEPLOYMENT", "STATE", "NODES", "ENDPOINT"]
    wide = render("get", "replica", REPLICA, wide=True)  # `get replica d-0`: one row
    assert "RESTARTS" in wide and "0,1" in wide and "ib-a" in wide


def test_get_nodes_narrow_and_wide() -> None:
    narrow = render("get", "node", [NODE])
    assert "ready,SchedulingDisabled" in narrow and "MGMT_ADDR" not in narrow
    assert "MGMT_ADDR" in render("get", "node", [NODE], wide=True)


def test_describe_node_and_replica() -> None:
    text = render("describe", "node", {**NODE, "replica_list": [REPLICA]})
    assert "Node:      n1" in text and "ib-a (up: mlx5_0)" in text and "d-0" in text
    assert "40/80GiB" in text
    text = render("describe", "replica", {**REPLICA, "spec": {"model": "m"}, "replaces": "",
                                          "pending": "", "last_log_tail": ["boom"],
                                          "events": [{"ts": 0, "replica": "d-0", "text": "ready"}]})
    assert "Replica:    d-0" in text and "  boom" in text and "ready" in text.splitlines()[-1]
