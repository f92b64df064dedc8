"""An engine's life on this node: its lifecycle table, the supervisor that converges on the
desired engines, and what watches each one (health, startup deadline, in-flight count,
download progress), its record on disk and adoption after an agent restart, sleep and wake."""
