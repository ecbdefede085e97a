"""A real HTTP proxy in front of the test S3 server that answers chosen requests with a
store's failures: ``503 SlowDown`` (throttling), ``500 InternalError``, or a connection
closed without an answer (a reset). Every other request goes to the server unchanged, so
the client (s3fs / botocore with ``endpoint_url`` = the proxy) meets the failures a real
store sends, through its own retry path, with nothing of ours mocked.

``FaultProxy(upstream).start()``; ``proxy.fail('PUT', r'iter_2\\.pth$', times=3)`` answers
the next three matching requests with SlowDown; ``proxy.refused`` counts the requests it
answered so, ``proxy.forwarded`` the others and ``proxy.seen`` lists them (method, path
and query: what a test counts the store's requests by); ``stop()``.
"""

from __future__ import annotations

import http.client
import re
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ANSWERS = {
    'slowdown': (503, 'SlowDown', 'Please reduce your request rate.'),
    'internal': (500, 'InternalError', 'We encountered an internal error. Please try again.'),
}


@dataclass
class _Rule:
    method: str | None
    path: re.Pattern
    times: int  # < 0: every time
    answer: str


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname or '127.0.0.1', parsed.port or 80)
        self.rules: list[_Rule] = []
        self.refused = 0
        self.forwarded = 0
        self.seen: list[tuple[str, str]] = []  # the forwarded requests, in order
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.endpoint = ''

    def fail(self, method: str | None, path: str, times: int = -1, answer: str = 'slowdown'):
        """Answer the next ``times`` requests (all when < 0) of ``method`` (any: None) whose
        path matches ``path`` with ``answer``: 'slowdown', 'internal' or 'reset'."""
        with self.lock:
            self.rules.append(_Rule(method, re.compile(path), times, answer))
        return self

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def _match(self, method: str, path: str) -> str | None:
        with self.lock:
            for rule in self.rules:
                if rule.times == 0 or (rule.method and rule.method != method):
                    continue
                if rule.path.search(urllib.parse.urlsplit(path).path):
                    rule.times -= 1 if rule.times > 0 else 0
                    self.refused += 1
                    return rule.answer
            self.forwarded += 1
            self.seen.append((method, path))
        return None

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'

            def log_message(self, *args):  # quiet: the tests read counts, not logs
                pass

            def _body(self) -> bytes:
                if self.headers.get('Transfer-Encoding', '').lower() == 'chunked':
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b';')[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b'\r\n', b'\n', b''):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get('Content-Length') or 0))

            def _handle(self) -> None:
                body = self._body()
                answer = proxy._match(self.command, self.path)
                if answer == 'reset':
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if answer is not None:
                    status, code, text = _ANSWERS[answer]
                    xml = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                        f'<Message>{text}</Message></Error>'
                    ).encode()
                    self.send_response(status)
                    self.send_header('Content-Type', 'application/xml')
                    self.send_header('Content-Length', str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() != 'transfer-encoding'
                }
                headers['Content-Length'] = str(len(body))
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                self.send_response(response.status, response.reason)
                length = str(len(data))
                for key, value in response.getheaders():
                    if key.lower() == 'content-length' and self.command == 'HEAD':
                        length = value  # the object's size, with no body
                    elif key.lower() not in ('transfer-encoding', 'content-length', 'connection'):
                        self.send_header(key, value)
                self.send_header('Content-Length', length)
                self.end_headers()
                if self.command != 'HEAD':
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f'http://127.0.0.1:{self.server.server_address[1]}'
        threading.Thread(
            target=self.server.serve_forever, kwargs={'poll_interval': 0.05}, daemon=True
        ).start()  # a short poll: stop() waits for it
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
