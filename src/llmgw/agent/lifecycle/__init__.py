"""An engine's life on this node: its lifecycle table and rules (states), the supervisor
that converges on the desired engines and its parts (start: the start pipeline, watch: one
engine's watcher to its exit, releases: its GPUs' release, health_watch, inplace: adapters
and sleep changed in place), what watches each engine (health, startup deadline, in-flight
count, download progress), its record on disk and adoption after an agent restart, sleep
and wake."""
