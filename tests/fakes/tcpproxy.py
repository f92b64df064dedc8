"""A TCP relay between a process and a server that a test can partition: while `drop`
is set, bytes are read and thrown away in both directions and the connections stay open,
as when a network path loses every packet (no RST, no FIN): one side closing during the
partition is not passed on either (the other side's socket stays open and silent). Threads in the test process;
`close` ends them and every socket."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.drop = threading.Event()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.drop.is_set():
                self._keep(client)  # a new connection during the partition: never answered
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            self._keep(client)
            self._keep(server)
            for a, b in ((client, server), (server, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        while not self._closed.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if self.drop.is_set():
                continue
            try:
                dst.sendall(data)
            except OSError:
                break
        if self.drop.is_set():
            return  # a FIN or RST lost in the partition: `close` ends both sockets
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the other pump

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for t in self._threads:
            t.join(timeout=2)
        with self._lock:
            for s in self._socks:
                s.close()
            self._socks.clear()
