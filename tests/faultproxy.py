"""A small HTTP proxy that sits between an S3 client and the test server and injects faults.

The client's endpoint points at the proxy (127.0.0.1, a free port); every request is
forwarded verbatim (Host header included, so request signatures stay valid) unless a fault
rule matches it. Rules match on the method and a substring of the path with its query, and fire a
bounded number of times:

- ``status``: answer with an HTTP error (e.g. 503 SlowDown, 403 AccessDenied) without forwarding;
- ``reset``: close the connection without an answer (a dropped connection);
- ``cut``: forward, then send the headers and half of the body and close (a dropped download);
- ``delay``: wait before forwarding (a stalled server, for client timeouts).

The proxy counts the requests it saw by method and the faults it injected.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}
_S3_CODES = {403: "AccessDenied", 404: "NoSuchBucket", 500: "InternalError", 503: "SlowDown"}


@dataclass
class Rule:
    method: str
    path_contains: str
    action: str  # "status", "reset", "cut" or "delay"
    times: int
    status: int = 503
    delay_s: float = 0.0
    fired: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (
            self.fired < self.times and self.method in ("*", method) and self.path_contains in path
        )


class FaultProxy:
    def __init__(self, upstream: str):
        u = urlparse(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.rules: list[Rule] = []
        self.requests: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return None

            def _handle(self) -> None:
                try:
                    proxy._serve(self)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client gave up (e.g. its timeout)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(
        self, method: str, path_contains: str, action: str, times: int = 1, **kw: float
    ) -> Rule:
        rule = Rule(method, path_contains, action, times, **kw)  # type: ignore[arg-type]
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.requests.clear()
            self.faults.clear()
            self.log.clear()

    def _match(self, method: str, path: str) -> Rule | None:
        with self._lock:
            self.requests[method] += 1
            self.log.append((method, path))
            for r in self.rules:
                if r.matches(method, path):
                    r.fired += 1
                    self.faults[r.action] += 1
                    return r
        return None

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        method, path = h.command, h.path
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        rule = self._match(method, path)
        if rule is not None and rule.action == "reset":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if rule is not None and rule.action == "status":
            code = _S3_CODES.get(rule.status, "Error")
            payload = f"<?xml version='1.0'?><Error><Code>{code}</Code></Error>".encode()
            h.send_response(rule.status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            if method != "HEAD":
                h.wfile.write(payload)
            return
        if rule is not None and rule.action == "delay":
            time.sleep(rule.delay_s)
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() != "connection"}
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            h.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP_BY_HOP:
                    h.send_header(k, v)
            declared = resp.getheader("Content-Length")
            h.send_header(
                "Content-Length", declared if method == "HEAD" and declared else str(len(data))
            )
            h.end_headers()
            if method == "HEAD":
                return
            if rule is not None and rule.action == "cut" and len(data) > 1:
                h.wfile.write(data[: len(data) // 2])
                h.wfile.flush()
                h.close_connection = True
                h.connection.shutdown(socket.SHUT_RDWR)
                return
            h.wfile.write(data)
        finally:
            conn.close()
