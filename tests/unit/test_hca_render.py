"""describe node names each unhealthy HCA (issue 22)."""

from __future__ import annotations


def test_describe_node_names_each_unhealthy_hca() -> None:
    from llmgw.ctl.render import _hca_notes

    hcas = [{"name": "mlx5_0", "healthy": False, "problems": ["port 1 DOWN (Disabled)"]},
            {"name": "mlx5_1", "healthy": True, "problems": []},
            {"name": "mlx5_2", "healthy": False, "problems": []}]
    assert _hca_notes(hcas) == [
        "HCA mlx5_0 unhealthy, not counted in its fabric: port 1 DOWN (Disabled)",
        "HCA mlx5_2 unhealthy, not counted in its fabric: no active port",
    ]

