"""The server's HTTP layer: reading requests, authorizing them, writing JSON and SSE replies.

The standard library's ``ThreadingHTTPServer`` serves one thread per connection (no dependency;
the traffic is one local user's). SSE is written with chunked transfer encoding, so streaming
connections stay reusable. A handler notices a client that left (a zero-timeout ``select`` plus
a ``MSG_PEEK``, or a failed write) and raises ``ClientGone``."""

from __future__ import annotations

import hmac
import json
import logging
import select
import socket
import sys
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from engine.errors import TandemError
from engine.serve import anthropic as anthropic_api
from engine.serve import openai as openai_api
from engine.serve.chat_format import RequestError

log = logging.getLogger("tandem.server")

MAX_BODY = 32 * 1024 * 1024


class ClientGone(Exception):
    pass


_DIALECTS = {"openai": openai_api, "anthropic": anthropic_api}


class RequestHandler(BaseHTTPRequestHandler):
    """HTTP mechanics for the routes (``engine.serve.routes``): body reading and its limits, the API
    key, JSON and SSE replies in the request's dialect, dispatch and error replies."""

    protocol_version = "HTTP/1.1"
    server_version = "tandem"
    timeout = 600  # an idle keep-alive connection lets its thread go after this long
    _endpoint, _sse_open, _body_read, _last_write = "other", False, True, 0.0

    @property
    def tandem(self) -> Any:
        """The ``engine.serve.server.TandemServer`` this handler serves (config, worker, metrics)."""
        return self.server.tandem  # type: ignore[attr-defined]

    # -- plumbing -------------------------------------------------------------------------------
    def log_message(self, fmt: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), fmt % args)

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        self.tandem.metrics.request(self._endpoint, int(code) if str(code).isdigit() else 0)
        log.info('"%s" %s', self.requestline, code)

    def _route(self) -> str:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        return path[3:] or "/" if path.startswith("/v1/") or path == "/v1" else path

    @property
    def _dialect(self) -> str:
        return "anthropic" if "/messages" in self.path or "anthropic-version" in self.headers else "openai"

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj, ensure_ascii=False).encode())

    def _error(self, status: int, message: str, *, kind: str | None = None, param: str | None = None,
               code: str | None = None) -> None:
        kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                        413: "request_too_large", 503: "overloaded_error"}.get(status, "api_error")
        if self._dialect == "openai" and kind == "api_error":
            kind = "server_error"
        self._json(status, _DIALECTS[self._dialect].error_body(message, kind, param, code))

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._sse_open = True

    def _write(self, frames: list[bytes] | bytes) -> None:
        data = b"".join(frames) if isinstance(frames, list) else frames
        if not data:
            return
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except OSError:  # BrokenPipe, ConnectionReset: the client left
            raise ClientGone() from None
        self._last_write = time.monotonic()

    def _end_sse(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True

    def _client_gone(self) -> bool:
        """The peer closed its end (EOF is readable); pipelined bytes don't count."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _authorized(self) -> bool:
        key = self.tandem.api_key
        if not key:
            return True
        auth = self.headers.get("Authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else self.headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), key.encode())

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
                if len(data) > MAX_BODY:
                    raise RequestError("request body too large", status=413, kind="request_too_large")
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("a request body with Content-Length is required", status=411)
        try:
            n = int(length)
        except ValueError:
            raise RequestError("bad Content-Length header") from None
        if n > MAX_BODY:
            raise RequestError(f"request body too large ({n} bytes; at most {MAX_BODY})", status=413, kind="request_too_large")
        return self.rfile.read(n)

    def _read_json(self) -> dict:
        raw = self._read_body()
        self._body_read = True
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    # -- dispatch -------------------------------------------------------------------------------


    # -- dispatch -------------------------------------------------------------------------------
    def _handle(self, routes: dict, get: bool) -> None:
        self._endpoint, self._sse_open, self._body_read = "other", False, get
        self._last_write = time.monotonic()
        route = self._route()
        fn = routes.get(route)
        if fn is None and get and route.startswith("/models/"):
            fn = self._models
        try:
            if fn is None:
                other = "POST" if get else "GET"
                self.close_connection = not self._body_read
                raise RequestError(f"no route {self.command} {urlsplit(self.path).path}"
                                   + (f" (try {other})" if route in ("/chat/completions", "/completions", "/messages",
                                                                    "/models", "/health", "/metrics", "/events") else ""),
                                   status=404, kind="not_found_error")
            self._endpoint = route
            if route != "/health" and not self._authorized():
                self.close_connection = not self._body_read
                raise RequestError("invalid API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                   status=401, kind="authentication_error")
            fn()
        except ClientGone:
            self.close_connection = True
        except RequestError as e:
            self._fail(e.status, str(e), kind=e.kind, param=e.param, code=e.code)
        except TandemError as e:
            self._fail(400, str(e))
        except Exception as e:
            log.error("%s %s failed:\n%s", self.command, self.path, traceback.format_exc())
            self._fail(500, f"internal error: {type(e).__name__}: {e}")

    def _fail(self, status: int, message: str, **kw: Any) -> None:
        if not self._body_read:
            self.close_connection = True  # the unread body would be taken for the next request
        try:
            if self._sse_open:  # the stream already began: say it in the stream, then end it
                writer = openai_api.ChatWriter if self._dialect == "openai" else anthropic_api.MessagesWriter
                self._write(writer.stream_error(message))
                self._end_sse()
            else:
                self._error(status, message, **kw)
        except (ClientGone, OSError):
            self.close_connection = True


class HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return  # a client that went away is not an error
        log.error("request from %s failed:\n%s", client_address, traceback.format_exc())
