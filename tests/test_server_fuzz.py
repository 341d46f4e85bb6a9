"""The outside review, kept in the suite: a few seconds of hostile and careless clients at once
against ``tandem serve`` over loopback, while one well-behaved client keeps asking.

Each fuzz client sends random raw requests (methods, paths, HTTP versions, Host/Origin/key
headers, framings that lie, bodies that are valid requests, mutated ones, garbage or a megabyte
of prompt, pipelined followers, cut off anywhere), then half-closes and reads to EOF. Checked:
no answer is a 5xx (but 501/505, which name what is unsupported), every exchange ends, the
well-behaved client is answered every time and promptly, and afterwards nothing is left in flight,
the threads are back, and /metrics still has a small fixed label set. Bounded by ``DURATION_S``;
deterministic inputs (seeded), so a failure replays."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time

import pytest

from engine.serve.server import make_server
from tests.tiny import make_tiny_engine

KEY = "sk-fuzz"
DURATION_S = 3.0
CLIENTS = 3
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
          "/health", "/metrics", "/events", "/", "/v1/models/x"]


@pytest.fixture(scope="module")
def srv():
    server = make_server(lambda: make_tiny_engine("llama", seed=0, scale=4.0), port=0, api_key=KEY, max_context=256,
                         default_max_tokens=4, keepalive_s=0.2).start()
    server.httpd.header_timeout = 1.0  # heads cut off mid-line end quickly
    yield server.wait_ready(60)
    server.stop()


def _body(rng: random.Random, path: str) -> bytes:
    words = " ".join(f"w{rng.randint(2, 95)}" for _ in range(rng.randint(1, 12)))
    valid = {"messages": [{"role": "user", "content": words}], "max_tokens": rng.randint(1, 4),
             "stream": rng.random() < 0.4}
    if "completions" in path and "chat" not in path:
        valid = {"prompt": words, "max_tokens": 2, "stream": valid["stream"]}
    pick = rng.random()
    if pick < 0.45:
        return json.dumps(valid).encode()
    if pick < 0.6:  # one field replaced by something odd
        key = rng.choice(list(valid) + ["tools", "top_p", "temperature", "seed", "tandem"])
        valid[key] = rng.choice([None, -1, 1e-46, 2**70, "x", [], {}, [{"type": "function", "function": {
            "name": "f", "parameters": "s"}}], {"mode": "nope"}])
        return json.dumps(valid).encode()
    if pick < 0.65:  # a prompt far beyond the context: refused at once
        return json.dumps({**valid, "messages": [{"role": "user", "content": "w7 " * 400_000}]}).encode()
    if pick < 0.8:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    return json.dumps(valid).encode()[: rng.randint(0, 40)]


def random_exchange(rng: random.Random) -> bytes:
    method = rng.choice(["GET", "POST", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "GE T", "post"])
    path = rng.choice(ROUTES + ["/v1/models/" + "".join(rng.choice('a"}\\%\x7f') for _ in range(5)),
                                "/" + "x" * rng.randint(0, 3000), "*"])
    version = rng.choice(["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2.0", "HTTP/1.x"])
    body = _body(rng, path) if method in ("POST", "GET", "PUT") and rng.random() < 0.9 else b""
    headers = []
    if rng.random() < 0.9:
        headers.append(rng.choice(["Host: 127.0.0.1", "Host: localhost:1", "Host: evil.example", "Host: [::1"]))
    auth = rng.random()
    if auth < 0.6:
        headers.append(f"Authorization: Bearer {KEY}")
    elif auth < 0.75:
        headers.append(rng.choice([f"x-api-key:  {KEY} ", "x-api-key: wrong", "Authorization: Basic eA=="]))
    if rng.random() < 0.2:
        headers.append(rng.choice(["Origin: https://evil.example", "Sec-Fetch-Site: cross-site", "Origin: null"]))
    if rng.random() < 0.3:
        headers.append(rng.choice(["Connection: close", "Connection: keep-alive"]))
    framing = rng.random()
    if framing < 0.6:
        headers.append(f"Content-Length: {len(body)}")
    elif framing < 0.7:
        headers.append(f"Content-Length: {len(body) + rng.choice([-3, 5, 10**9])}")
    elif framing < 0.8:
        headers.append("Transfer-Encoding: chunked")
        body = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)) if body else b"0\r\n\r\n"
    elif framing < 0.85:
        headers += ["Transfer-Encoding: chunked", f"Content-Length: {len(body)}"]
    data = (f"{method} {path} {version}\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode("latin-1") + body
    if rng.random() < 0.3:  # a pipelined follower
        data += f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    if rng.random() < 0.1:  # cut off anywhere
        data = data[: rng.randint(0, len(data))]
    return data


def exchange(server, data: bytes, timeout: float = 20.0) -> bytes:
    sock = socket.create_connection((server.host, server.port), timeout=timeout)
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out
    except ConnectionResetError:  # refused before reading what was sent (a 413 with its body unread)
        return out
    finally:
        sock.close()


def metric(server, name: str) -> float:
    reply = exchange(server, f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                             "Connection: close\r\n\r\n".encode()).decode()
    return float(next(line.split()[-1] for line in reply.splitlines() if line.startswith(name + " ")))


def test_hostile_and_careless_clients_for_a_few_seconds(srv):
    threads_before = threading.active_count()
    deadline = time.monotonic() + DURATION_S
    problems: list[str] = []
    counts = {"exchanges": 0, "steady": 0}
    slowest = [0.0]
    lock = threading.Lock()

    def fuzz(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            data = rng.choice([random_exchange, random_exchange, random_exchange])(rng)
            try:
                reply = exchange(srv, data)
            except Exception as e:  # a hang (timeout) or a refused connection
                with lock:
                    problems.append(f"{type(e).__name__}: {e} for {data[:120]!r}")
                continue
            bad = [s for s in map(int, re.findall(rb"HTTP/1\.[01] (\d{3}) [A-Z]", reply)) if s >= 500 and s not in (501, 505)]
            with lock:
                counts["exchanges"] += 1
                if bad:
                    problems.append(f"{bad} for {data[:200]!r}: {reply[:300]!r}")

    def steady() -> None:
        body = json.dumps({"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2}).encode()
        request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                   f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            sock = socket.create_connection((srv.host, srv.port), timeout=20)
            sock.sendall(request)  # no half-close: a half-closed client counts as gone
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            sock.close()
            with lock:
                slowest[0] = max(slowest[0], time.perf_counter() - t0)
                counts["steady"] += 1
                if not reply.startswith(b"HTTP/1.1 200"):
                    problems.append(f"steady client: {reply[:200]!r}")

    workers = [threading.Thread(target=fuzz, args=(i,)) for i in range(CLIENTS)] + [threading.Thread(target=steady)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not problems, problems[:5]
    assert counts["exchanges"] >= 20 and counts["steady"] >= 3, counts
    assert slowest[0] < 5.0, slowest  # the one engine is shared, but nobody waits behind a big prompt

    end = time.monotonic() + 10
    while (metric(srv, "tandem_requests_in_flight") or metric(srv, "tandem_queue_depth")) and time.monotonic() < end:
        time.sleep(0.05)
    assert metric(srv, "tandem_requests_in_flight") == 0 and metric(srv, "tandem_queue_depth") == 0
    while threading.active_count() > threads_before + 2 and time.monotonic() < end:
        time.sleep(0.05)  # handler threads of closed connections end
    assert threading.active_count() <= threads_before + 2
    reply = exchange(srv, f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    series = [line for line in reply.decode().splitlines() if line.startswith("tandem_requests_total{")]
    assert len(series) < 60, len(series)
