"""The server's HTTP layer: reading requests, authorizing them, writing JSON and SSE replies.

The standard library's ``ThreadingHTTPServer`` serves one thread per connection (no dependency;
the traffic is one local user's), at most ``MAX_CONNECTIONS`` at once (more get a 503 from the
accepting thread), and a connection idle for ``HEADER_TIMEOUT`` while its next request's head is
awaited is closed. SSE is written with chunked transfer encoding, so streaming connections stay
reusable; HTTP/1.0 clients get the bare stream, ended by closing. ``Connection: close`` and
HTTP/1.0 are honoured on every reply, errors included. A handler notices a client that left (a
zero-timeout ``select`` plus a ``MSG_PEEK``, or a failed write) and raises ``ClientGone``.

What a hostile client or a web page can send is refused before any work is done:

* Bodies, on every method (a GET body left unread would be parsed as the next request):
  ``Content-Length`` must be plain digits, at most ``MAX_BODY``, and the body is read to
  exactly that length (400/411/413 before reading); chunked bodies are read with bounded lines,
  sizes checked before each chunk is read, framing counted against the limit, at most
  ``MAX_CHUNKS`` chunks. JSON must be
  standard (no NaN/Infinity), nested at most ``MAX_JSON_DEPTH`` deep, with no lone surrogates.
* Web pages (``Access``): any page the user opens can POST to 127.0.0.1 without a CORS
  preflight, and DNS rebinding lets it read the replies. So a request whose Host is a name this
  server does not answer to, or that carries a browser Origin (or a cross-site
  ``Sec-Fetch-Site``) not allowed by ``--allow-origin``, gets 403. Clients without an Origin
  (curl, the SDKs, agents) are served as before; no CORS headers unless an origin is allowed.
* Log lines escape control characters (a request line cannot forge log entries).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import re
import select
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable
from urllib.parse import urlsplit

from engine.errors import TandemError
from engine.serve import anthropic as anthropic_api
from engine.serve import openai as openai_api
from engine.serve.chat_format import RequestError

log = logging.getLogger("tandem.server")

MAX_BODY = 32 * 1024 * 1024
MAX_LINE = 1024  # a chunk-size or trailer line
MAX_TRAILERS = 64
MAX_CHUNKS = 1 << 16  # a flood of tiny chunks costs a thread seconds of parsing
MAX_JSON_DEPTH = 100
MAX_CONNECTIONS = 128  # open connections, each served by its own thread; more get a 503 at once
HEADER_TIMEOUT = 30.0  # s: a connection idle while its next request's head is awaited is closed
LISTEN_BACKLOG = 128  # connections the kernel queues while the server accepts (socketserver's was 5)

_CONTROL_CHARS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROL_CHARS[ord("\\")] = "\\\\"


def escape_log(text: str) -> str:
    """Control characters (and backslashes) as escapes, so one request is one log line."""
    return text.translate(_CONTROL_CHARS)


def key_scope(key: str) -> str:
    """The name of an API key's own history of drafts (``Engine.history``): a hash, so the key
    itself is never kept beside it."""
    return hashlib.sha256(b"tandem-api-key|" + key.encode()).hexdigest()[:32]


class ClientGone(Exception):
    pass


# -- who may talk to the server -------------------------------------------------------------------

WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def _host_name(value: str) -> str | None:
    """The name in a Host header ('example:8080', '[::1]:8080', 'localhost.'), lowercased; None
    when it is malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = (value[1:end], value[end + 1 :]) if end > 0 else ("", "")
    else:
        name, sep, port = value.partition(":")
        rest = sep + port
    if not name or (rest and not re.fullmatch(r":[0-9]{1,5}", rest)):
        return None
    return name.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """Which Host names and browser Origins the server answers (``"*"``: any).

    An IP-literal Host is always accepted: DNS rebinding needs a name the attacker controls, and
    a page can only present an IP Host by being served from that address itself."""

    hosts: frozenset[str]
    origins: frozenset[str] = frozenset()

    @classmethod
    def for_bind(cls, bind_host: str, allow_hosts: Iterable[str] = (), allow_origins: Iterable[str] = ()) -> "Access":
        """localhost, the bound name, ``allow_hosts``; for a wildcard bind (0.0.0.0, ::) also this
        machine's host names, as other machines reach it by those."""
        hosts = {"localhost", bind_host.strip("[]").lower()} | {h.strip().lower().rstrip(".") for h in allow_hosts}
        if bind_host in WILDCARD_HOSTS:
            for name in (socket.gethostname(), socket.getfqdn()):
                name = name.lower().rstrip(".")
                hosts |= {name, name.split(".")[0] + ".local"} if name else set()
        return cls(frozenset(h for h in hosts if h), frozenset(o.strip().lower().rstrip("/") for o in allow_origins))

    def host_allowed(self, header: str | None) -> bool:
        if header is None or "*" in self.hosts:
            return True  # no Host: HTTP/1.0 tools; browsers always send one
        name = _host_name(header)
        return name is not None and (name in self.hosts or _is_ip(name))

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin.strip().lower().rstrip("/") in self.origins


def _check_json(value: Any) -> None:
    """Nesting depth and lone surrogates (which no tokenizer or UTF-8 writer accepts)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(item, dict):
            stack.extend((k, depth) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError("the request body has a string with an unpaired surrogate "
                                   "(\\ud800-\\udfff)") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


_DIALECTS = {"openai": openai_api, "anthropic": anthropic_api}


class RequestHandler(BaseHTTPRequestHandler):
    """HTTP mechanics for the routes (``engine.serve.routes``): body reading and its limits, the API
    key, JSON and SSE replies in the request's dialect, dispatch and error replies."""

    protocol_version = "HTTP/1.1"
    server_version = "tandem"
    timeout = 600  # a request's socket reads and writes (its body, a stream) give up after this long
    _endpoint, _sse_open, _body_read, _last_write, _chunked = "other", False, True, 0.0, True
    _cors_origin: str | None = None  # an allowed browser Origin to answer with CORS headers
    client_scope: str | None = None  # the request's API key's history of drafts (``_authorized``)

    @property
    def tandem(self) -> Any:
        """The ``engine.serve.server.TandemServer`` this handler serves (config, worker, metrics)."""
        return self.server.tandem  # type: ignore[attr-defined]

    # -- plumbing -------------------------------------------------------------------------------
    def handle_one_request(self) -> None:
        """One request; while its head is awaited (a fresh connection or a kept-alive one) the socket
        times out after the server's ``header_timeout``, so idle clients do not keep a thread."""
        self._endpoint = "other"
        self.connection.settimeout(getattr(self.server, "header_timeout", HEADER_TIMEOUT))
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.connection.settimeout(self.timeout)  # the head is in: the request's own time limits
        return ok

    def log_message(self, fmt: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), escape_log(fmt % args))

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        self.tandem.metrics.request(self._endpoint, int(code) if str(code).isdigit() else 0)
        log.info('"%s" %s', escape_log(self.requestline), code)

    def end_headers(self) -> None:
        retry_after, self._retry_after = getattr(self, "_retry_after", None), None
        if retry_after:
            self.send_header("Retry-After", str(retry_after))
        if self._cors_origin:
            self.send_header("Access-Control-Allow-Origin", self._cors_origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

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
        kind = kind or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 411: "invalid_request_error", 413: "request_too_large",
                        501: "invalid_request_error", 503: "overloaded_error"}.get(status, "api_error")
        if self._dialect == "openai" and kind == "api_error":
            kind = "server_error"
        self._json(status, _DIALECTS[self._dialect].error_body(message, kind, param, code))

    def _start_sse(self) -> None:
        """Open a stream: chunked for HTTP/1.1; an HTTP/1.0 client cannot parse chunks, so it gets the
        bare stream, ended by closing the connection."""
        self._chunked = self.request_version == "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        self._sse_open = True

    def _write(self, frames: list[bytes] | bytes) -> None:
        data = b"".join(frames) if isinstance(frames, list) else frames
        if not data:
            return
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        except OSError:  # BrokenPipe, ConnectionReset: the client left
            raise ClientGone() from None
        self._last_write = time.monotonic()

    def _end_sse(self) -> None:
        if not self._chunked:
            return  # the connection's close ends it
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
        """Whether the request carries one of the server's keys (any, when it has none); sets
        ``client_scope``, the key's own history of drafts (None: the process's, no keys)."""
        self.client_scope = None
        keys = self.tandem.api_keys
        if not keys:
            return True
        auth = self.headers.get("Authorization", "")
        given = (auth[7:] if auth.lower().startswith("bearer ") else self.headers.get("x-api-key", "")).strip().encode()
        matched = [key for key in keys if hmac.compare_digest(given, key.encode())]  # every key compared: no timing
        if matched:
            self.client_scope = key_scope(matched[0])
        return bool(matched)

    def _declares_body(self) -> bool:
        return bool(self.headers.get_all("Transfer-Encoding")) or any(
            v.strip() != "0" for v in self.headers.get_all("Content-Length") or [])

    def _read_body(self) -> bytes:
        """The request body, within ``MAX_BODY``; malformed framing is refused before reading."""
        codings = [c.strip().lower() for v in self.headers.get_all("Transfer-Encoding") or [] for c in v.split(",")]
        lengths = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        if codings:
            if lengths:
                raise RequestError("a request must not carry both Transfer-Encoding and Content-Length")
            if codings != ["chunked"]:
                raise RequestError(f"unsupported Transfer-Encoding '{escape_log(', '.join(codings))[:60]}': "
                                   "send the body chunked or with Content-Length", status=501)
            return self._read_chunked()
        if not lengths:
            raise RequestError("a request body with Content-Length is required", status=411)
        length = lengths.pop() if len(lengths) == 1 else ""
        if not re.fullmatch(r"[0-9]{1,20}", length):
            raise RequestError("bad Content-Length header: it must be one non-negative integer")
        n = int(length)
        if n > MAX_BODY:
            raise RequestError(f"request body too large ({n} bytes; at most {MAX_BODY})", status=413,
                               kind="request_too_large")
        data = self.rfile.read(n)
        if len(data) < n:
            raise RequestError(f"the request body ended after {len(data)} of its {n} bytes")
        return data

    def _read_chunked(self) -> bytes:
        parts, total = [], 0
        while True:
            if len(parts) >= MAX_CHUNKS:
                raise RequestError(f"a chunked request body of more than {MAX_CHUNKS} chunks", status=413,
                                   kind="request_too_large")
            line = self._line("chunk-size")
            size_text = line.split(b";", 1)[0].strip()
            if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size_text):
                raise RequestError("bad chunk-size line in a chunked request body")
            size = int(size_text, 16)
            total += len(line) + size + 2  # framing counts too
            if total > MAX_BODY:
                raise RequestError(f"request body too large (more than {MAX_BODY} bytes)", status=413,
                                   kind="request_too_large")
            if size == 0:
                break
            chunk = self.rfile.read(size)
            if len(chunk) < size:
                raise RequestError("the request body ended inside a chunk")
            parts.append(chunk)
            if self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise RequestError("a chunk of the request body is not followed by CRLF")
        for _ in range(MAX_TRAILERS):
            if self._line("trailer") in (b"\r\n", b"\n"):
                return b"".join(parts)
        raise RequestError(f"more than {MAX_TRAILERS} trailer lines after a chunked request body")

    def _line(self, what: str) -> bytes:
        line = self.rfile.readline(MAX_LINE + 1)
        if not line.endswith(b"\n"):
            raise RequestError(f"bad {what} line in a chunked request body (longer than {MAX_LINE} bytes, "
                               "or the body ended)")
        return line

    def _read_json(self) -> dict:
        raw = self._read_body()
        self._body_read = True
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except RecursionError:
            raise RequestError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        _check_json(body)
        return body

    def _check_access(self) -> None:
        """Refuse what a web page could send (see the module doc); note an allowed Origin for CORS."""
        access: Access = self.tandem.access
        host = self.headers.get("Host")
        if not access.host_allowed(host):
            name = escape_log(str(_host_name(host or "") or host))[:80]
            raise RequestError(f"Host '{name}' is not one this server answers to (DNS rebinding guard); "
                               f"to allow it, start tandem serve with --allow-host {name}", status=403,
                               kind="permission_error")
        origin = self.headers.get("Origin")
        if origin is not None:
            if not access.origin_allowed(origin):
                raise RequestError(f"requests from web pages (Origin '{escape_log(origin)[:80]}') are refused; "
                                   "to allow a page, start tandem serve with --allow-origin ORIGIN", status=403,
                                   kind="permission_error")
            self._cors_origin = origin.strip()
        elif self.headers.get("Sec-Fetch-Site", "").lower() in ("cross-site", "same-site"):
            raise RequestError("requests from other sites' web pages are refused", status=403, kind="permission_error")

    # -- dispatch -------------------------------------------------------------------------------
    def _handle(self, routes: dict, get: bool) -> None:
        # A POST's body is read by its route; a GET or HEAD with one (rare, and a smuggling vector:
        # unread, it would be parsed as the next request) has it read below, or the connection closes.
        self._endpoint, self._sse_open, self._cors_origin = "other", False, None
        self._body_read = get and not self._declares_body()
        self._last_write = time.monotonic()
        route = self._route()
        fn = routes.get(route)
        if fn is None and get and route.startswith("/models/"):
            fn = self._models
        try:
            self._check_access()
            if fn is None:
                other = "POST" if get else "GET"
                raise RequestError(f"no route {self.command} {urlsplit(self.path).path}"
                                   + (f" (try {other})" if route in ("/chat/completions", "/completions", "/messages",
                                                                    "/models", "/health", "/metrics", "/events") else ""),
                                   status=404, kind="not_found_error")
            self._endpoint = "/models/{id}" if route.startswith("/models/") else route  # a fixed label set
            if route != "/health" and not self._authorized():
                raise RequestError("invalid API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                   status=401, kind="authentication_error")
            if get and not self._body_read:  # a GET or HEAD that came with a body: read within the limits, dropped
                self._read_body()
                self._body_read = True
            fn()
        except ClientGone:
            self.close_connection = True
        except RequestError as e:
            self._retry_after = getattr(e, "retry_after", None)  # a full queue: when to come back
            self._fail(e.status, str(e), kind=e.kind, param=e.param, code=e.code)
        except TandemError as e:
            self._fail(400, str(e))
        except Exception as e:
            log.error("%s %s failed:\n%s", self.command, escape_log(self.path), traceback.format_exc())
            self._fail(500, f"internal error: {type(e).__name__}: {e}")

    def do_OPTIONS(self) -> None:
        """CORS preflight: answered for allowed origins only (no CORS headers otherwise)."""
        self._endpoint, self._sse_open, self._cors_origin = "other", False, None
        self._body_read = not self._declares_body()
        try:
            self._check_access()
        except RequestError as e:
            self._fail(e.status, str(e), kind=e.kind)
            return
        self.send_response(204)
        if self._cors_origin:
            wanted = self.headers.get("Access-Control-Request-Headers", "")
            self.send_header("Access-Control-Allow-Methods", "GET, HEAD, POST, OPTIONS")
            if re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~, -]{0,1000}", wanted):
                self.send_header("Access-Control-Allow-Headers", wanted)
            self.send_header("Access-Control-Max-Age", "600")
        else:
            self.send_header("Allow", "GET, HEAD, POST, OPTIONS")
        self.send_header("Content-Length", "0")
        if not self._body_read:  # a preflight has no body; one that came is not read
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()

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
    """One thread per open connection, at most ``max_connections`` of them: a connection beyond
    that gets a 503 from the accepting thread and is closed, so a flood of idle sockets costs no
    threads; an idle one is closed after ``header_timeout``."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, *args: Any, **kw: Any):
        self.max_connections, self.header_timeout = MAX_CONNECTIONS, HEADER_TIMEOUT
        self._open = 0
        self._open_lock = threading.Lock()
        super().__init__(*args, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            full = self._open >= self.max_connections
            self._open += not full
        if not full:
            super().process_request(request, client_address)
            return
        body = b'{"error": {"type": "overloaded_error", "message": "too many open connections"}}'
        try:
            request.setblocking(False)
            request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        except OSError:
            pass
        self.close_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1

    def shutdown_request(self, request: Any) -> None:
        """Close gently: a client still sending a body we refused (413) must get to read the answer,
        which an immediate close with unread data would destroy with a TCP reset."""
        try:
            request.shutdown(socket.SHUT_WR)
            request.settimeout(0.25)
            deadline = time.monotonic() + 1.0
            for _ in range(64):  # at most 4 MiB drained, at most about a second
                if time.monotonic() > deadline or not request.recv(65536):
                    break
        except OSError:
            pass
        self.close_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return  # a client that went away is not an error
        log.error("request from %s failed:\n%s", client_address, traceback.format_exc())
