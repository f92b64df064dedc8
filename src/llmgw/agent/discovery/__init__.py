"""What a node has: GPUs with NVLink peers, InfiniBand fabrics, model storage.

The parsers here are pure (text or a directory in, attrs out); `discover.discover` is the
thin trio shell that runs the slow parts in `trio.to_thread`.
"""
