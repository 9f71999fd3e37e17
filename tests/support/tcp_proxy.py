"""A TCP forwarder on loopback that a test can stop and start again: a real endpoint going away.

Put in front of moto's S3 server, stopping it is an outage as clients see one (connections
refused, open connections reset) while the store's contents survive behind it, so a test can
bring the endpoint back and check that a rerun resumes from what was published. With ``delay``,
every chunk is held that long in each direction: a distant endpoint (latency, not bandwidth).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from tests.support.servers import free_port


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port`` while started, each chunk
    ``delay`` seconds late."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1", port: int | None = None,
                 delay: float = 0.0):
        self.target = (target_host, target_port)
        self.delay = delay
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-proxy").start()
        return self

    def stop(self) -> None:
        """Refuse new connections and reset every open one."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # stopped meanwhile
                    client.close(), upstream.close()
                    return
                self._conns |= {client, upstream}
                self.connections += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
            src.close()
