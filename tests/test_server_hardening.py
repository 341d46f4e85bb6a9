"""What a hostile client or a web page can send ``tandem serve``: bounded bodies, Host and Origin
checks, clean 4xx for bad values, escaped logs; the API key kept out of ``ps``; ``tandem claude``
keeping prompts on the machine. Fuzzed parsers and a load test with disconnects and oversized
requests. A tiny random engine (tests/tiny.py) answers: seconds, not minutes."""

from __future__ import annotations

import copy
import http.client
import json
import logging
import socket
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cli import build_parser, main
from engine.cli import claude as claude_cli
from engine.cli.serve import api_key_from
from engine.errors import TandemError
from engine.serve import anthropic as anthropic_api
from engine.serve import openai as openai_api
from engine.serve.chat_format import RequestError, render_chat
from engine.serve.http import MAX_BODY, MAX_CHUNKS, MAX_JSON_DEPTH, Access
from engine.serve.server import make_server
from tests.test_server import SMOLLM2_TEMPLATE, make_scripted_engine
from tests.tiny import make_tiny_engine, make_tokenizer

CHAT = {"messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def srv():
    server = make_server(lambda: make_tiny_engine("llama", seed=0, scale=4.0), port=0, max_context=512,
                         default_max_tokens=8).start()
    yield server.wait_ready(60)
    server.stop()


def exchange(server, head: str, body: bytes = b"", *, half_close: bool = False, timeout: float = 5.0):
    """Raw bytes in, (status, headers, body) out; a server that does not answer fails by timeout."""
    sock = socket.create_connection((server.host, server.port), timeout=timeout)
    try:
        sock.sendall(head.encode("latin-1") + body)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        sock.close()


def post_head(path: str, *headers: str) -> str:
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"


def request(server, method: str, path: str, body=None, headers=None, timeout: float = 30):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers or {})
    resp = conn.getresponse()
    text = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, text


def metric(server, name: str) -> float:
    _, _, text = request(server, "GET", "/metrics")
    return float(next(line.split()[-1] for line in text.decode().splitlines() if line.startswith(name + " ")))


# -- 1. bodies ------------------------------------------------------------------------------------

BODY = json.dumps(CHAT).encode()


@pytest.mark.parametrize("headers,body,status,half_close", [
    (["Content-Length: -1"], BODY, 400, False),  # read(-1) used to read until the client closed
    (["Content-Length: +10"], BODY, 400, False),
    (["Content-Length: 1_0"], BODY, 400, False),
    ([f"Content-Length: {len(BODY)}", "Content-Length: 5"], BODY, 400, False),
    ([f"Content-Length: {40 << 20}"], b"", 413, False),  # refused before a byte of it is read
    ([], BODY, 411, False),
    (["Transfer-Encoding: gzip"], BODY, 501, False),
    (["Transfer-Encoding: chunked", f"Content-Length: {len(BODY)}"], BODY, 400, False),
    (["Transfer-Encoding: chunked"], b"-1\r\n" + BODY, 400, False),  # a negative chunk size
    (["Transfer-Encoding: chunked"], b"7fffffff\r\n" + BODY, 413, False),  # one huge chunk: refused unread
    (["Transfer-Encoding: chunked"], b"0" * 5000 + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY), 400,
     False),  # a chunk-size line of any length
    (["Transfer-Encoding: chunked"], b"5\r\nabcdeXY0\r\n\r\n", 400, False),  # no CRLF after the chunk
    ([f"Content-Length: {len(BODY) + 50}"], BODY, 400, True),  # the client stopped short
])
def test_body_framing_is_refused_before_reading(srv, headers, body, status, half_close):
    got, _, text = exchange(srv, post_head("/v1/chat/completions", *headers), body, half_close=half_close)
    assert got == status, text
    assert json.loads(text)["error"]["message"]
    assert request(srv, "GET", "/health")[0] == 200


def test_chunked_bodies_within_limits_are_served(srv):
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(BODY[i:i + 7]), BODY[i:i + 7]) for i in range(0, len(BODY), 7))
    status, _, text = exchange(srv, post_head("/v1/chat/completions", "Transfer-Encoding: chunked"),
                               chunks + b"0\r\nX-Trailer: 1\r\n\r\n")
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"]
    many = b"1\r\n \r\n" * (MAX_CHUNKS + 1) + b"0\r\n\r\n"  # a flood of tiny chunks
    status, _, text = exchange(srv, post_head("/v1/chat/completions", "Transfer-Encoding: chunked"), many)
    assert status == 413 and b"chunks" in text


# -- 2. web pages ---------------------------------------------------------------------------------

def test_requests_from_web_pages_are_refused(srv):
    generations = metric(srv, "tandem_generations_total")
    # DNS rebinding: the page's name resolves to 127.0.0.1, but the Host header still names it.
    for host in ("evil.example", f"evil.example:{srv.port}", "127.0.0.1.evil.example", "[::1"):
        status, _, text = request(srv, "GET", "/v1/models", headers={"Host": host})
        assert status == 403 and "Host" in json.loads(text)["error"]["message"], host
    for host in ("localhost", f"localhost:{srv.port}", "LOCALHOST.", f"127.0.0.1:{srv.port}", f"[::1]:{srv.port}"):
        assert request(srv, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    # A page POSTs text/plain (no preflight): refused by its Origin, nothing generated.
    status, headers, text = request(srv, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                                    {"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert status == 403 and "--allow-origin" in json.loads(text)["error"]["message"]
    assert "access-control-allow-origin" not in headers
    assert request(srv, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})[0] == 403
    assert request(srv, "GET", "/metrics", headers={"Sec-Fetch-Site": "cross-site"})[0] == 403
    assert request(srv, "GET", "/events", headers={"Origin": "null"})[0] == 403
    assert metric(srv, "tandem_generations_total") == generations
    # No Origin (curl, SDKs, agents): served as before, whatever the Content-Type, and no CORS headers.
    status, headers, _ = request(srv, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                                 {"Content-Type": "text/plain"})
    assert status == 200 and "access-control-allow-origin" not in headers


def test_allowed_hosts_and_origins():
    server = make_server(lambda: make_tiny_engine("llama", seed=0), port=0, max_context=256, default_max_tokens=2,
                         allow_hosts=("tandem.lan",), allow_origins=("http://localhost:3000",)).start()
    try:
        server.wait_ready(60)
        assert request(server, "GET", "/health", headers={"Host": "tandem.lan:8080"})[0] == 200
        assert request(server, "GET", "/health", headers={"Host": "other.lan"})[0] == 403
        status, headers, _ = request(server, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 204 and headers["access-control-allow-origin"] == "http://localhost:3000"
        assert headers["access-control-allow-headers"] == "authorization, content-type"
        status, headers, _ = request(server, "POST", "/v1/chat/completions", CHAT, {"Origin": "http://localhost:3000"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
        assert request(server, "POST", "/v1/chat/completions", CHAT, {"Origin": "http://localhost:3001"})[0] == 403
    finally:
        server.stop()


def test_wildcard_bind_answers_this_machines_names_only():
    access = Access.for_bind("0.0.0.0")
    assert access.host_allowed(socket.gethostname()) and access.host_allowed(f"{socket.getfqdn()}:8080")
    assert access.host_allowed("192.168.1.20:8080") and access.host_allowed("[fe80::1]")  # IP literals
    assert not access.host_allowed("attacker.example")
    assert Access.for_bind("127.0.0.1", allow_hosts=["*"]).host_allowed("anything.example")


# -- 3. the API key out of ps -----------------------------------------------------------------------

def test_api_key_from_environment_or_file(tmp_path, monkeypatch, capsys):
    parse = build_parser("serve").parse_args
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert api_key_from(parse(["serve"])) is None
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert api_key_from(parse(["serve"])) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert api_key_from(parse(["serve", "--api-key-file", str(key_file)])) == "from-file"
    assert api_key_from(parse(["serve", "--api-key", "flag"])) == "flag"
    assert "visible to other users" in capsys.readouterr().err
    with pytest.raises(TandemError, match="not both"):
        api_key_from(parse(["serve", "--api-key", "x", "--api-key-file", str(key_file)]))
    key_file.write_text("\n")
    with pytest.raises(TandemError, match="on one line"):
        api_key_from(parse(["serve", "--api-key-file", str(key_file)]))
    with pytest.raises(TandemError, match="cannot read --api-key-file"):
        api_key_from(parse(["serve", "--api-key-file", str(tmp_path / "missing")]))


# -- 4. tandem claude keeps prompts on the machine --------------------------------------------------

PROVIDER_ENV = {
    "CLAUDE_CODE_USE_BEDROCK": "1", "CLAUDE_CODE_USE_VERTEX": "1", "CLAUDE_CODE_USE_FOUNDRY": "1",
    "CLAUDE_CODE_USE_ANTHROPIC_AWS": "1", "CLAUDE_CODE_USE_MANTLE": "1", "CLAUDE_CODE_USE_SOMETHING_NEW": "1",
    "ANTHROPIC_BEDROCK_BASE_URL": "https://b", "ANTHROPIC_BEDROCK_MANTLE_BASE_URL": "https://m",
    "ANTHROPIC_VERTEX_BASE_URL": "https://v", "ANTHROPIC_VERTEX_PROJECT_ID": "p",
    "ANTHROPIC_FOUNDRY_BASE_URL": "https://f", "ANTHROPIC_FOUNDRY_RESOURCE": "r", "ANTHROPIC_FOUNDRY_API_KEY": "k",
    "ANTHROPIC_AWS_WORKSPACE_ID": "w", "ANTHROPIC_AWS_API_KEY": "k", "AWS_BEARER_TOKEN_BEDROCK": "t",
    "CLAUDE_CODE_SKIP_BEDROCK_AUTH": "1", "CLAUDE_CODE_SKIP_VERTEX_AUTH": "1", "CLAUDE_CODE_SKIP_FOUNDRY_AUTH": "1",
    "CLAUDE_CODE_OAUTH_TOKEN": "o", "CLAUDE_CODE_API_KEY_FILE_DESCRIPTOR": "3", "ANTHROPIC_UNIX_SOCKET": "/s",
    "CLAUDE_CODE_API_BASE_URL": "https://x", "ANTHROPIC_CUSTOM_HEADERS": "cf-aig-authorization: Bearer t",
}


def test_claude_child_gets_no_provider_variables():
    base = {"PATH": "/bin", "HOME": "/home/u", "AWS_REGION": "us-east-1", "HTTPS_PROXY": "http://proxy:3128",
            "NO_PROXY": "corp.example", "CLAUDE_CODE_USE_NATIVE_FILE_SEARCH": "1", "ANTHROPIC_API_KEY": "sk-real"}
    env = claude_cli.child_env({**base, **PROVIDER_ENV}, "http://127.0.0.1:8080", "m", "key")
    assert not set(PROVIDER_ENV) & set(env)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080" and env["ANTHROPIC_AUTH_TOKEN"] == "key"
    assert env["ANTHROPIC_API_KEY"] == "" and env["CLAUDE_CODE_USE_NATIVE_FILE_SEARCH"] == "1"
    assert env["NO_PROXY"] == env["no_proxy"] == "corp.example,localhost,127.0.0.1,::1"  # the proxy never sees it
    assert claude_cli.child_env(base, "http://gpu-box:8080", "m", None)["NO_PROXY"] == "corp.example"


def test_claude_cli_end_to_end_keeps_key_and_prompts_local(srv, tmp_path, monkeypatch, capfd):
    for name, value in PROVIDER_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TANDEM_API_KEY", "sk-local-key")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("CLAUDE_CONFIG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    code = ("import os, sys; print(sorted(k for k in os.environ if k in %r), os.environ['ANTHROPIC_AUTH_TOKEN'], "
            "sys.argv[1:])" % sorted(PROVIDER_ENV))
    args = ["claude", "--port", str(srv.port), "--claude", sys.executable, "--", "-c", code, "go"]
    assert main(args) == 0
    assert "[] sk-local-key ['go']" in capfd.readouterr().out  # none of them, the key by environment only

    assert main(["claude", "--port", str(srv.port), "--print-env"]) == 0
    out = capfd.readouterr().out
    assert "export ANTHROPIC_AUTH_TOKEN=sk-local-key" in out and "unset CLAUDE_CODE_USE_BEDROCK" in out

    # A settings file's env overrides the environment: one that routes elsewhere is refused, naming the file.
    (tmp_path / ".claude").mkdir()
    settings = tmp_path / ".claude" / "settings.json"
    settings.write_text(json.dumps({"env": {"CLAUDE_CODE_USE_VERTEX": "1", "ANTHROPIC_BASE_URL": "https://gw.example",
                                            "CLAUDE_CODE_USE_BEDROCK": "0", "ANTHROPIC_CUSTOM_HEADERS": "x: y"}}))
    assert main(args) == 1
    err = capfd.readouterr().err
    assert "settings.json sets ANTHROPIC_BASE_URL, CLAUDE_CODE_USE_VERTEX in its" in err and "[]" not in err
    settings.write_text(json.dumps({"env": {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{srv.port}/", "X": "1"}}))
    assert main(args) == 0


# -- 5. bad values, logs, HEAD ----------------------------------------------------------------------

def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/chat/completions", {**CHAT, "seed": -1}, "'seed' must be between 0 and"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, "'seed' must be between 0 and"),
    ("/v1/messages", {**CHAT, "seed": -5}, "'seed' must be between 0 and"),
    ("/v1/completions", {"prompt": "w5", "seed": 10**30}, "'seed' must be between 0 and"),
    ("/v1/chat/completions", {**CHAT, "temperature": 10**400}, "'temperature' must be between"),
    ("/v1/chat/completions", BODY[:-1] + b', "temperature": NaN}', "not valid JSON"),
    ("/v1/chat/completions", BODY[:-1] + b', "top_p": Infinity}', "not valid JSON"),
    ("/v1/chat/completions", _nested(100_000), "nested more than"),  # RecursionError in json
    ("/v1/messages", _nested(MAX_JSON_DEPTH + 5), "nested more than"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "unpaired surrogate"),
    ("/v1/messages/count_tokens", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "unpaired surrogate"),
])
def test_bad_values_get_a_clean_400(srv, path, body, fragment):
    status, _, text = request(srv, "POST", path, body)
    message = json.loads(text)["error"]["message"]
    assert status == 400 and fragment in message, message


def test_log_lines_escape_control_characters(srv, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.server"):
        forged = exchange(srv, "GET /health\x1b[2J\x07?x=\x1b HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0]
        garbled = exchange(srv, "GET /x\x85\x1b[1A HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0]  # \x85 splits it
        time.sleep(0.1)  # the log line is written after the reply
    assert (forged, garbled) == (404, 400)
    lines = [r.getMessage() for r in caplog.records]
    assert all(not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in m) for m in lines), lines
    assert any("/health\\x1b[2J\\x07?x=\\x1b" in m for m in lines), lines


def test_head_on_events_sends_headers_only(srv):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=5)
    conn.request("HEAD", "/events")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    assert resp.read() == b""
    conn.request("GET", "/health")  # the same connection: nothing of a stream is left in it
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
    conn.close()


# -- 6. fuzzing and load ----------------------------------------------------------------------------

# Fuzzing by mutation: rich valid requests of each dialect with one or two values (anywhere in
# them, keys included) replaced by arbitrary JSON or deleted, so every check deep inside a request
# is reached (random JSON alone stops at the first field it fails).
OAI_SEEDS = [
    {"model": "m", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "developer", "content": "and kind"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"y": [1, 2]}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "function", "name": "g", "content": [{"type": "text", "text": "fine"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}],
     "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
         "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}},
               {"type": "function", "function": {"name": "g"}}],
     "tool_choice": {"type": "function", "function": {"name": "f"}}, "max_tokens": 3, "max_completion_tokens": 2,
     "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 1, "stop": ["a", "b"], "stream": False,
     "stream_options": {"include_usage": True}, "n": 1, "response_format": {"type": "text"},
     "frequency_penalty": 0, "logprobs": False, "tandem": {"mode": "lookup", "max_draft": 2}},
    {"prompt": "w5 w6", "echo": True, "max_tokens": 2, "best_of": 1, "seed": 3, "suffix": None},
    {"prompt": [[5, 6, 7]], "stop": "x", "tandem": {"max_draft": "auto"}},
]
ANT_SEEDS = [
    {"model": "m", "max_tokens": 3, "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
     "messages": [
         {"role": "user", "content": "hi"},
         {"role": "assistant", "content": [
             {"type": "thinking", "thinking": "t", "signature": "s"}, {"type": "text", "text": "calling"},
             {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
         {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": [
                 {"type": "text", "text": "r"}, {"type": "image", "source": {"type": "base64", "data": "AA"}}]},
             {"type": "tool_result", "tool_use_id": "toolu_1", "content": "plain"},
             {"type": "text", "text": "and?"}]},
         {"role": "assistant", "content": ""}],
     "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {"x": {}}}},
               {"type": "web_search_20250305", "name": "web_search"}, {"type": "custom", "name": "g"}],
     "tool_choice": {"type": "tool", "name": "f"}, "thinking": {"type": "enabled", "budget_tokens": 100},
     "stop_sequences": ["x"], "temperature": 1, "top_p": 0.5, "top_k": 3, "seed": 2, "stream": False,
     "metadata": {"user_id": "u"}, "tandem": {"mode": "baseline"}},
    {"max_tokens": 1, "system": "plain", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
]
DELETE = object()
odd_values = st.sampled_from([None, True, 0, -1, 2**64, 10**30, 1.5, -1e308, "", "x", "\x00", [], [None], ["x"],
                              [[1]], {}, {"": None}, {"name": 5}, DELETE])
weird = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=6), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


def _paths(value, at=()):
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from _paths(item, at + (key,))


def _mutated(seed: dict, edits) -> dict:
    body = json.loads(json.dumps(seed))
    for path, value in edits:
        parent = body
        try:
            for key in path[:-1]:
                parent = parent[key]
            if value is DELETE and isinstance(parent, dict):
                parent.pop(path[-1], None)
            elif value is not DELETE:
                parent[path[-1]] = copy.deepcopy(value)  # never the same object twice (a cycle)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed this path
    return body


def mutations(seeds):
    def edits_of(seed: dict):
        paths = st.sampled_from([p for p in _paths(seed) if p])
        return st.lists(st.tuples(paths, odd_values | weird), min_size=1, max_size=2).map(
            lambda edits: _mutated(seed, edits))

    return st.one_of(*[edits_of(seed) for seed in seeds])


FUZZ = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _template_tokenizer():
    tok = make_tokenizer()
    tok._tokenizer.chat_template = SMOLLM2_TEMPLATE
    return tok


TOKENIZERS = [make_tokenizer(), _template_tokenizer(), make_scripted_engine().tokenizer]


def _parse_and_render(parse, body) -> None:
    """``parse`` either accepts ``body`` or raises RequestError (a 4xx); what it accepts renders with
    each tokenizer (none, a ChatML template, a tool template) or fails as a TandemError (a 400)."""
    try:
        spec = parse(body)
    except RequestError as e:
        assert 400 <= e.status < 500 and "\n" not in str(e)
        return
    json.dumps(spec.messages, ensure_ascii=False).encode()
    if spec.kind != "chat":
        return
    for tok in TOKENIZERS:
        try:
            text_, ids = render_chat(tok, spec.messages, spec.tools)
        except TandemError:
            continue
        assert isinstance(text_, str) and all(isinstance(i, int) for i in ids)


@FUZZ
@given(body=mutations(OAI_SEEDS[:1]))
def test_openai_chat_parsing_and_rendering_refuse_cleanly(body):
    _parse_and_render(openai_api.parse_chat, body)


@settings(FUZZ, max_examples=100)
@given(body=mutations(OAI_SEEDS[1:]))
def test_openai_completion_parsing_refuses_cleanly(body):
    _parse_and_render(openai_api.parse_completion, body)


@FUZZ
@given(body=mutations(ANT_SEEDS), count_only=st.booleans())
def test_anthropic_parsing_and_rendering_refuse_cleanly(body, count_only):
    _parse_and_render(lambda b: anthropic_api.parse_request(b, count_only=count_only), body)


PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"]


@settings(max_examples=60, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), body=mutations(OAI_SEEDS + ANT_SEEDS) | weird | st.binary(max_size=40),
       stream=st.booleans())
def test_fuzzed_requests_never_get_5xx(srv, path, body, stream):
    if isinstance(body, dict):
        body = {**body, "max_tokens": 2, "stream": stream}  # keep generations short
        body.pop("max_completion_tokens", None)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, text = request(srv, "POST", path, data)
    assert status < 500, text[:300]


def test_load_with_disconnects_and_oversized_requests(srv):
    """Clients at once: normal and streamed requests (all answered, and right), streams dropped
    halfway, oversized and malformed bodies; afterwards nothing is left queued or in flight."""
    prompts = [f"w{5 + i} w{30 + i} w{60 + i}" for i in range(4)]
    def answer(p: str) -> str:
        body = {"messages": [{"role": "user", "content": p}], "max_tokens": 6}
        return json.loads(request(srv, "POST", "/v1/chat/completions", body)[2])["choices"][0]["message"]["content"]

    ref = {p: answer(p) for p in prompts}
    errors: list[str] = []
    answered = [0]
    lock = threading.Lock()

    def fail(what: str) -> None:
        with lock:
            errors.append(what)

    def client(i: int) -> None:
        for j in range(6):
            p = prompts[(i + j) % 4]
            body = {"messages": [{"role": "user", "content": p}], "max_tokens": 6}
            kind = (i + j) % 5
            try:
                if kind == 0:
                    status, _, text = request(srv, "POST", "/v1/chat/completions", body)
                    if status != 200 or json.loads(text)["choices"][0]["message"]["content"] != ref[p]:
                        fail(f"plain {status} {text[:100]}")
                elif kind == 1:
                    status, _, text = request(srv, "POST", "/v1/chat/completions", {**body, "stream": True})
                    chunks = [json.loads(line[6:]) for line in text.decode().splitlines()
                              if line.startswith("data: {")]
                    got = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
                    if status != 200 or got != ref[p] or not text.decode().rstrip().endswith("data: [DONE]"):
                        fail(f"stream {status} {got!r}")
                elif kind == 2:  # hang up in the middle of a long stream
                    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
                    conn.request("POST", "/v1/completions", json.dumps(
                        {"prompt": p, "max_tokens": 400, "stream": True, "tandem": {"mode": "baseline"}}))
                    resp = conn.getresponse()
                    resp.readline()
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    conn.close()
                    continue
                elif kind == 3:
                    status = exchange(srv, post_head("/v1/messages", f"Content-Length: {MAX_BODY + 1}"))[0]
                    if status != 413:
                        fail(f"oversized {status}")
                else:
                    status, _, _ = request(srv, "POST", "/v1/messages", b'{"messages": [')
                    if status != 400:
                        fail(f"malformed {status}")
                with lock:
                    answered[0] += 1
            except Exception as e:  # a lost request: counted, the others go on
                fail(f"{kind}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert answered[0] == sum(1 for i in range(6) for j in range(6) if (i + j) % 5 != 2)
    deadline = time.monotonic() + 10
    busy = lambda: metric(srv, "tandem_requests_in_flight") or metric(srv, "tandem_queue_depth")  # noqa: E731
    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(srv, "tandem_requests_in_flight") == 0 and metric(srv, "tandem_queue_depth") == 0
    assert request(srv, "GET", "/health")[0] == 200
