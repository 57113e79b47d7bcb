"""A loopback TCP relay between two nodes whose link a test cuts and restores (a network
split on one machine, without namespaces): a node that names the relay as its bootstrap
peer reaches the other only through it."""

from __future__ import annotations

import contextlib
import socket
import threading

CONNECT_TIMEOUT_SECONDS = 5.0


class LinkProxy:
    """Relays connections to `127.0.0.1:target_port` from `endpoint` while up; `cut`
    closes every relayed connection and refuses new ones until `restore`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(16)
        self.port: int = self._server.getsockname()[1]
        self.up = True
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        """The zenoh endpoint of the relay, for `--bootstrap-peers`."""
        return f"tcp/127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            if not self.up:
                client.close()
                continue
            try:
                upstream = socket.create_connection(
                    ("127.0.0.1", self.target_port), timeout=CONNECT_TIMEOUT_SECONDS
                )
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Close every relayed connection; refuse new ones until `restore`."""
        self.up = False
        with self._lock:
            for end in self._sockets:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()
            self._sockets.clear()

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self.cut()
        self._server.close()
