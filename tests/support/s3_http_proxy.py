"""An HTTP forwarding proxy on loopback in front of an S3 endpoint (moto's server), for what moto
itself does not do: an S3-compatible store without upload checksums (as older MinIO, Ceph RGW,
GCS's XML API). ``checksums="reject"``: any PUT carrying a checksum header is answered 400
InvalidArgument; ``"ignore"``: a PUT's checksum headers are dropped (the store keeps none);
everything else passes through. It counts the requests it forwards, by method and path, so a
test can tell which objects were read (GET) or asked (HEAD).
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections import Counter

from tests.support.servers import free_port

#: Request headers by which a client asks the store to keep (and check) a checksum of an upload
CHECKSUM_HEADERS = ("x-amz-checksum-sha256", "x-amz-sdk-checksum-algorithm", "x-amz-checksum-crc32",
                    "x-amz-checksum-crc32c", "x-amz-checksum-sha1", "x-amz-checksum-algorithm")
#: Hop-by-hop headers (RFC 9110 7.6.1) and the length, which this proxy sets itself
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                  "proxy-connection", "content-length"})
_REJECTION = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidArgument</Code>'
              b"<Message>x-amz-checksum headers are not supported</Message></Error>")


class S3HttpProxy:
    """Forwards HTTP requests on ``127.0.0.1:port`` to ``127.0.0.1:target_port``; PUTs with a
    checksum header (:data:`CHECKSUM_HEADERS`) as ``checksums`` says ("reject", "ignore", "pass")."""

    def __init__(self, target_port: int, checksums: str = "reject"):
        assert checksums in ("reject", "ignore", "pass"), checksums
        self.target_port = target_port
        self.checksums = checksums
        self.port = free_port()
        self.requests: Counter[tuple[str, str]] = Counter()  # (method, path without the query) → count
        self.rejected = 0
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, method: str, path_part: str = "") -> int:
        """Requests of ``method`` forwarded so far whose path holds ``path_part``."""
        with self._lock:
            return sum(n for (m, p), n in self.requests.items() if m == method and path_part in p)

    def __enter__(self) -> S3HttpProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                dropped = set(CHECKSUM_HEADERS) if self.command == "PUT" and proxy.checksums != "pass" else set()
                if proxy.checksums == "reject" and dropped & {k.lower() for k in self.headers}:
                    with proxy._lock:
                        proxy.rejected += 1
                    return self._answer(400, [("Content-Type", "application/xml")], _REJECTION)
                with proxy._lock:
                    proxy.requests[(self.command, self.path.split("?")[0])] += 1
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=30)
                try:
                    upstream.request(self.command, self.path, body=body,
                                     headers={k: v for k, v in self.headers.items()
                                              if k.lower() not in _HOP and k.lower() not in dropped})
                    response = upstream.getresponse()
                    data = response.read()
                    self._answer(response.status, response.getheaders(), data)
                finally:
                    upstream.close()

            def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                # a HEAD's length is the object's, as the store gave it (no body follows)
                length = dict((k.lower(), v) for k, v in headers).get("content-length")
                self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

            def log_message(self, *args) -> None:  # quiet: pytest shows failures, not every request
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True, name="s3-http-proxy").start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
