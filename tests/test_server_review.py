"""``tandem serve`` against a second outside review: one client must never stall the others, and
nothing a client sends reaches past its own request. Each test here failed before its fix: a
huge prompt tokenized under a global lock, /metrics labels from raw paths, GET bodies parsed as
the next request, ``Connection: close`` and HTTP/1.0 ignored, a thread per idle socket, tiny
``top_p``, keys with spaces, 403's kind, assistant prefills, non-object tool parameters. A tiny
random engine (tests/tiny.py) answers over loopback: seconds."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest

from engine.cli import build_parser
from engine.cli.serve import api_key_from
from engine.serve.metrics import Metrics
from engine.serve.server import make_server
from tests.tiny import make_tiny_engine

KEY = "sk-review"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 512


@pytest.fixture(scope="module")
def srv():
    server = make_server(lambda: make_tiny_engine("llama", seed=0, scale=4.0), port=0, api_key=KEY,
                         max_context=CONTEXT, default_max_tokens=6).start()
    yield server.wait_ready(60)
    server.stop()


def send(server, data: bytes, *, timeout: float = 10.0, half_close: bool = True) -> bytes:
    """Raw bytes in; every byte the server sends until it closes (a hang fails by timeout)."""
    sock = socket.create_connection((server.host, server.port), timeout=timeout)
    try:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out
    finally:
        sock.close()


def statuses(data: bytes) -> list[int]:
    """The status of every response in ``data`` (bodies here never hold a status line)."""
    return [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) [A-Z]", data)]


def head(method: str, path: str, *headers: str, version: str = "HTTP/1.1", auth: bool = True) -> bytes:
    lines = [f"{method} {path} {version}", "Host: 127.0.0.1", *([f"Authorization: Bearer {KEY}"] if auth else []),
             *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def post(server, path: str, body, headers=None, timeout: float = 30) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={**AUTH, **(headers or {})})
    resp = conn.getresponse()
    status, text = resp.status, resp.read()
    conn.close()
    return status, json.loads(text)


def chat(content, **kw) -> dict:
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return {"messages": messages, "max_tokens": 6, **kw}


# -- 1. a huge prompt --------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", lambda text: chat(text)),
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 2}),
    ("/v1/messages/count_tokens", lambda text: {"messages": [{"role": "user", "content": text}]}),
])
def test_a_huge_prompt_is_refused_at_once_and_stalls_no_one(srv, path, body):
    """6 MiB of prompt used to be rendered and tokenized (seconds of CPU) under the one tokenizer
    lock before the context check, and another client's 2-token request waited for it."""
    post(srv, "/v1/chat/completions", chat("w5 w6"))  # warm
    t0 = time.perf_counter()
    assert post(srv, "/v1/chat/completions", chat("w5 w6"))[0] == 200
    normal = time.perf_counter() - t0
    huge = " ".join(f"w{5 + i % 80}" for i in range(2_000_000))  # 6 MiB, ~2M tokens
    got: dict = {}

    def big() -> None:
        t = time.perf_counter()
        got["status"], got["body"] = post(srv, path, body(huge))
        got["s"] = time.perf_counter() - t

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.2)  # the huge request is in
    t0 = time.perf_counter()
    status, reply = post(srv, "/v1/chat/completions", chat("w7 w8"))
    small = time.perf_counter() - t0
    thread.join(60)
    assert status == 200 and reply["choices"][0]["message"]["content"]
    assert got["status"] == 400 and got["s"] < 1.0, (got["s"], got["body"])
    message = got["body"]["error"]["message"]
    assert re.search(r"at least \d+ tokens|prompt is too long: \d+ tokens > 512", message), message
    assert small < normal + 1.0, (small, normal)


def test_a_prompt_within_the_bound_still_gets_its_exact_count(srv):
    long = " ".join(f"w{5 + i % 80}" for i in range(600))  # 600 tokens: tokenized, counted exactly
    status, body = post(srv, "/v1/chat/completions", chat(long))
    assert status == 400 and "your prompt is 6" in body["error"]["message"]  # ChatML adds a few
    status, body = post(srv, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": long}]})
    assert status == 200 and body["input_tokens"] > 600


# -- 2. /metrics -------------------------------------------------------------------------------------

def test_metrics_labels_stay_a_fixed_set_under_10000_distinct_paths(srv):
    paths = [f"/v1/models/m{i}" for i in range(9_990)] + [
        '/v1/models/x"}%20evil{a="b', "/v1/models/a\\b", "/nothing/%22}", "/v1/models/%0a", "/x\\\"y"]
    for start in range(0, len(paths), 500):  # pipelined on one connection, 500 at a time
        batch = paths[start:start + 500]
        data = b"".join(head("GET", p).replace(b"\r\n\r\n", b"\r\nConnection: keep-alive\r\n\r\n")
                        for p in batch)
        answers = statuses(send(srv, data))
        assert len(answers) == len(batch) and set(answers) <= {200, 404}, set(answers)
    import http.client

    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    conn.request("GET", "/metrics", headers=AUTH)
    text = conn.getresponse().read().decode()
    conn.close()
    series = [line for line in text.splitlines() if line.startswith("tandem_requests_total{")]
    assert 0 < len(series) < 20, len(series)
    label = re.compile(r'tandem_requests_total\{endpoint="(?:[^"\\\n]|\\.)*",status="\d{3}"\} \d+')
    assert all(label.fullmatch(line) for line in series), series
    assert any('endpoint="/models/{id}",status="200"' in line for line in series)


def test_metric_label_values_are_escaped():
    metrics = Metrics()
    metrics.request('a"}\nforged{x="1\\', 200)
    (line,) = [x for x in metrics.render().splitlines() if x.startswith("tandem_requests_total{")]
    assert line == 'tandem_requests_total{endpoint="a\\"}\\nforged{x=\\"1\\\\",status="200"} 1'


# -- 3. bodies on every method, Connection: close, HTTP/1.0 -------------------------------------------

@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_get_or_head_body_is_never_parsed_as_the_next_request(srv, method):
    smuggled = head("GET", "/v1/smuggled")
    framings = [(f"Content-Length: {len(smuggled)}",), ("Transfer-Encoding: chunked",)]
    for framing in framings:
        body = smuggled if framing[0].startswith("Content") else b"%x\r\n%s\r\n0\r\n\r\n" % (len(smuggled), smuggled)
        data = head(method, "/health", *framing) + body + head("GET", "/health", "Connection: close")
        answers = statuses(send(srv, data))
        assert answers == [200, 200], (framing, answers)  # no 404 for /v1/smuggled


def test_connection_close_and_http_1_0_are_honoured_on_errors(srv):
    """A client reading to EOF used to wait 600 s: 401 and 404 kept the connection open."""
    for data in (head("GET", "/v1/nowhere", "Connection: close"),
                 head("GET", "/v1/models", "Connection: close", auth=False),
                 head("GET", "/v1/nowhere", version="HTTP/1.0"),
                 head("GET", "/v1/models", version="HTTP/1.0", auth=False)):
        answers = statuses(send(srv, data, timeout=5, half_close=False))  # no half-close: only the server may end it
        assert len(answers) == 1 and answers[0] in (401, 404), answers


def test_http_1_0_stream_is_not_chunked(srv):
    body = json.dumps(chat("w5 w6", stream=True)).encode()
    data = head("POST", "/v1/chat/completions", f"Content-Length: {len(body)}", version="HTTP/1.0") + body
    reply = send(srv, data, timeout=10, half_close=False)
    headers, _, stream = reply.partition(b"\r\n\r\n")
    assert statuses(reply) == [200] and b"chunked" not in headers.lower()
    lines = [line for line in stream.split(b"\n") if line]
    assert lines[-1] == b"data: [DONE]" and all(line.startswith(b"data: ") for line in lines), lines[:3]


# -- 4. connections: bounded threads, idle ones closed, a real backlog ----------------------------------

def test_idle_sockets_cost_bounded_threads_and_are_closed(srv):
    httpd = srv.httpd
    saved = httpd.max_connections, httpd.header_timeout
    httpd.max_connections, httpd.header_timeout = 8, 0.5
    socks = []
    try:
        before = threading.active_count()
        for _ in range(40):
            socks.append(socket.create_connection((srv.host, srv.port), timeout=5))
        time.sleep(0.2)
        assert threading.active_count() - before <= 8
        refused = 0
        for s in socks[8:]:  # beyond the limit: a 503 at once, then closed
            data = s.recv(4096)
            refused += data.startswith(b"HTTP/1.1 503")
        assert refused == 32
        for s in socks[:8]:  # idle past the header timeout: closed by the server
            assert s.recv(4096) == b""
            s.close()
        deadline = time.monotonic() + 5
        while (status := post(srv, "/v1/chat/completions", chat("w5"))[0]) == 503 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server's side of the closed sockets is let go
        assert status == 200
    finally:
        for s in socks:
            s.close()
        httpd.max_connections, httpd.header_timeout = saved
    assert httpd.request_queue_size >= 128  # 300 rapid connects used to wait on a backlog of 5


# -- 5. the smaller items ------------------------------------------------------------------------------

def test_a_tiny_top_p_keeps_the_most_likely_token(srv):
    greedy = post(srv, "/v1/chat/completions", chat("w9 w10"))[1]["choices"][0]["message"]["content"]
    status, body = post(srv, "/v1/chat/completions", chat("w9 w10", temperature=1.0, top_p=1e-46, seed=3))
    assert status == 200 and body["choices"][0]["message"]["content"] == greedy != ""


def test_api_keys_with_spaces(srv, monkeypatch):
    """A key set with spaces around it (a quoted export, a pasted line) locked every client out."""
    monkeypatch.setenv("TANDEM_API_KEY", f" {KEY}  ")
    assert api_key_from(build_parser("serve").parse_args(["serve"])) == KEY
    spaced = make_server(lambda: None, port=0, api_key=f"  {KEY} \n")  # not started: its key is all we read
    spaced.httpd.server_close()
    assert spaced.api_key == KEY
    for headers in ({"x-api-key": f"  {KEY} "}, {"Authorization": f"Bearer  {KEY} "}, {"x-api-key": KEY}):
        status, _ = post(srv, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "w5"}]},
                         {"Authorization": "", **headers})
        assert status == 200, headers


def test_a_web_page_gets_permission_error(srv):
    for path, body in (("/v1/chat/completions", chat("w5")), ("/v1/messages", {**chat("w5"), "max_tokens": 2})):
        status, err = post(srv, path, body, {"Origin": "https://evil.example"})
        kind = err["error"]["type"]
        assert status == 403 and kind == "permission_error", (path, kind)


def test_a_final_assistant_message_is_continued(srv):
    """The reply continues the assistant's prefill: the same tokens as a completion of the
    ChatML prompt that ends inside the assistant's turn."""
    messages = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8"}]
    status, reply = post(srv, "/v1/chat/completions", chat(messages))
    assert status == 200
    prompt = "<|im_start|>user\nw5 w6<|im_end|>\n<|im_start|>assistant\nw7 w8"
    _, plain = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 6})
    assert reply["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert reply["choices"][0]["message"]["content"] == plain["choices"][0]["text"].strip()
    status, msg = post(srv, "/v1/messages", {**chat(messages), "max_tokens": 6})
    usage = msg["usage"]  # Anthropic counts the tokens the prefix cache restored apart
    assert status == 200 and usage["input_tokens"] + usage["cache_read_input_tokens"] == plain["usage"]["prompt_tokens"]
    assert msg["content"][0]["text"] == reply["choices"][0]["message"]["content"]
    # An empty final assistant message has nothing to continue: a plain generation prompt.
    status, empty = post(srv, "/v1/chat/completions", chat(messages[:1] + [{"role": "assistant", "content": ""}]))
    _, first = post(srv, "/v1/chat/completions", chat(messages[:1]))
    assert status == 200 and empty["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path,tools,param", [
    ("/v1/chat/completions", [{"type": "function", "function": {"name": "f", "parameters": "yes"}}],
     "tools[0].function.parameters"),
    ("/v1/chat/completions", [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
     "tools[0].function.parameters"),
    ("/v1/messages", [{"name": "f", "input_schema": 5}], None),
])
def test_tool_parameters_must_be_an_object(srv, path, tools, param):
    status, err = post(srv, path, {**chat("w5"), "tools": tools})
    assert status == 400 and "JSON Schema object" in err["error"]["message"], err
    if param:
        assert err["error"]["param"] == param
