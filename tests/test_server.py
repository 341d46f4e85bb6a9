"""The API server, end to end over loopback with the real openai and anthropic SDKs.

Two in-process servers on ephemeral ports:

* ``tiny``: a random tiny llama (tests/tiny.py) whose tokenizer has no chat template, so chat
  prompts take the documented ChatML fallback. Used where any output will do (protocol shape,
  stream == non-stream, lookup == baseline, concurrency, limits).
* ``scripted``: a real mlx-lm llama whose weights are set by hand so that greedy decoding
  continues a fixed script chosen by the prompt's last word (one-hot embeddings, residual-only
  layers, and an lm_head that maps each token to its successor). Its chat template ends with the
  last message's text, so "weather" makes the model emit a ``<tool_call>``, a tool result "sunny"
  makes it answer in words, "ponder" makes it reason in ``<think>``, "count" never stops.
  That gives deterministic tool-call round trips, reasoning and stop sequences through the real
  engine, drafter and verify loop. It runs with an API key.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import threading
import time

import anthropic
import mlx.core as mx
import openai
import pytest
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.serve.chat_format import OutputParser, render_chat
from engine.generate import Engine
from engine.serve.server import make_server
from tests.tiny import make_tiny_engine, make_tokenizer

KEY = "sk-test-key"
TOOLS_OAI = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOLS_ANT = [{"name": "get_weather", "description": "Current weather in a city",
              "input_schema": TOOLS_OAI[0]["function"]["parameters"]}]

# trigger word -> the words the scripted model continues with (then EOS; "count" cycles forever)
SCRIPTS = {
    "weather": ['<tool_call>', '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', '</tool_call>'],
    "sunny": ["It's", "warm", "in", "Paris."],
    "ponder": ["<think>", "hmm,", "easy.", "</think>", "Answer:", "42"],
    "recite": ["alpha", "beta", "gamma", "delta", "epsilon"],
    "clock": ['{"name":"get_time",', '"arguments":{}}'],
    "count": ["one", "two", "three"],
}
DEFAULT_SCRIPT = ["Hello", "there,", "friend."]
SCRIPTED_TEMPLATE = (
    "{%- for t in tools or [] %}tool:{{ t.function.name }} {% endfor %}"
    "{%- for m in messages %}{{ m.role }}: "
    "{%- for c in m.tool_calls or [] %} <tool_call> {{ c.function.name }} {{ c.function.arguments | tojson }} </tool_call>{% endfor %}"
    " {{ m.content }} {% endfor %}"
)


def make_scripted_engine() -> Engine:
    words = ["</s>", "<s>"] + list(SCRIPTS) + [w for s in SCRIPTS.values() for w in s] + DEFAULT_SCRIPT
    assert len(set(words)) == len(words), "script words must be distinct"
    size = 64
    words += [f"pad{i}" for i in range(size - len(words))]
    ids = {w: i for i, w in enumerate(words)}
    succ = {i: ids[DEFAULT_SCRIPT[0]] for i in range(size)}
    for trigger, script in list(SCRIPTS.items()) + [(None, DEFAULT_SCRIPT)]:
        chain = ([trigger] if trigger else []) + script
        for a, b in zip(chain, chain[1:]):
            succ[ids[a]] = ids[b]
        succ[ids[script[-1]]] = ids[script[0]] if trigger == "count" else ids["</s>"]
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", unk_token="<s>")
    fast.chat_template = SCRIPTED_TEMPLATE

    args = llama.ModelArgs(model_type="llama", hidden_size=size, num_hidden_layers=1, intermediate_size=size,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=size, rms_norm_eps=1e-5,
                           rope_theta=10000.0, tie_word_embeddings=False)
    model = llama.Model(args)
    model.model.embed_tokens.weight = mx.eye(size)  # one-hot embeddings
    for layer in model.model.layers:  # layers add nothing to the residual stream
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    head = [[0.0] * size for _ in range(size)]
    for i, j in succ.items():
        head[j][i] = 10.0  # logit of the successor: 10 * sqrt(64) = 80 above every other token
    model.lm_head.weight = mx.array(head)
    mx.eval(model.parameters())
    model.eval()
    return Engine(model, TokenizerWrapper(fast), name="scripted")


@pytest.fixture(scope="module")
def tiny():
    srv = make_server(lambda: make_tiny_engine("llama", seed=0, scale=4.0), port=0, max_context=512).start()
    yield srv.wait_ready(60)
    srv.stop()


@pytest.fixture(scope="module")
def scripted():
    srv = make_server(make_scripted_engine, port=0, api_key=KEY, max_context=1_000_000, keepalive_s=0.2).start()
    yield srv.wait_ready(60)
    srv.stop()


def oai(srv, key="x") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)


def ant(srv, key="x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=30)


def raw(srv, method: str, path: str, body=None, headers=None) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


def sse_events(resp, until=None, limit=10_000) -> list[tuple[str | None, str]]:
    """(event, data) pairs read from an SSE response (comments as ('comment', text))."""
    out, event = [], None
    for _ in range(limit):
        line = resp.readline()
        if not line:
            break
        line = line.decode().rstrip("\n")
        if line.startswith(":"):
            out.append(("comment", line[1:].strip()))
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            out.append((event, line[5:].strip()))
            event = None
            if until and until(out):
                break
    return out


CHAT = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w5 w6 w7 w8"},
        {"role": "assistant", "content": "w11 w12"}, {"role": "user", "content": "w13 w14 w15"}]


# -- OpenAI ---------------------------------------------------------------------------------------

def test_openai_chat_stream_matches_nonstream_with_telemetry(tiny):
    client = oai(tiny)
    full = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert full.usage.completion_tokens == full.x_tandem["tokens"] and full.usage.prompt_tokens > 10
    assert choice.finish_reason == {"length": "length", "stop": "stop"}[full.x_tandem["finish_reason"]]
    for key in ("mode", "cap", "accept_per_round", "decode_tok_s", "prefill_s", "decode_s", "target_forwards"):
        assert key in full.x_tandem

    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].x_tandem["tokens"] == full.x_tandem["tokens"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_lookup_output_equals_baseline(tiny):
    client = oai(tiny)
    texts, stats = {}, {}
    for mode in ("baseline", "lookup"):
        r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60,
                                           extra_body={"tandem": {"mode": mode}})
        texts[mode], stats[mode] = r.choices[0].message.content, r.x_tandem
    assert stats["baseline"]["mode"] == "baseline" and stats["lookup"]["mode"] == "lookup"
    assert stats["lookup"]["drafted"] > 0  # lookup really speculated
    assert texts["lookup"] == texts["baseline"]
    assert stats["lookup"]["tokens"] == stats["baseline"]["tokens"]
    # The Anthropic route runs the same engine: same prompt, same greedy output.
    msg = ant(tiny).messages.create(model="tiny", max_tokens=60, system="w9 w10", messages=CHAT[1:],
                                    extra_body={"tandem": {"mode": "lookup"}})
    assert msg.content[0].text == texts["baseline"]


def test_seeded_sampling_is_reproducible(tiny):
    def sample(seed: int, **kw) -> str:
        return oai(tiny).chat.completions.create(model="t", messages=CHAT, max_tokens=30, temperature=1.0, top_p=0.95,
                                                 seed=seed, **kw).choices[0].message.content
    a = sample(7)
    assert sample(7) == a and sample(8) != a
    top1 = sample(7, extra_body={"top_k": 1})  # top_k=1 is greedy whatever the temperature
    assert top1 == oai(tiny).chat.completions.create(model="t", messages=CHAT, max_tokens=30).choices[0].message.content


def test_completions_endpoint_and_models(tiny):
    client = oai(tiny)
    r = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=12, seed=3)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="w5 w6 w7", max_tokens=12, stream=True) if c.choices)
    assert r.choices[0].text and streamed == r.choices[0].text
    assert r.usage.prompt_tokens == 3
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    assert [m.id for m in ant(tiny).models.list()] == ["tiny-llama"]


def test_concurrent_clients_all_answered_in_order(tiny):
    client = oai(tiny)
    prompts = [f"w{5 + i} w{20 + i} w{40 + i}" for i in range(4)]
    ref = {p: client.chat.completions.create(model="t", messages=[{"role": "user", "content": p}],
                                             max_tokens=8).choices[0].message.content for p in prompts}
    got: dict[int, list] = {i: [] for i in range(4)}

    def worker(i: int) -> None:
        c = oai(tiny)
        for _ in range(3):
            r = c.chat.completions.create(model="t", messages=[{"role": "user", "content": prompts[i]}], max_tokens=8)
            got[i].append(r.choices[0].message.content)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(got[i] == [ref[prompts[i]]] * 3 for i in range(4)), got


# -- Anthropic ----------------------------------------------------------------------------------

def test_anthropic_messages_stream_events_and_telemetry(tiny):
    client = ant(tiny)
    full = client.messages.create(model="tiny", max_tokens=20, system=[{"type": "text", "text": "w9 w10"}],
                                  messages=[{"role": "user", "content": [{"type": "text", "text": "w5 w6 w7 w8"}]}])
    assert full.role == "assistant" and full.content[0].type == "text"
    assert full.usage.output_tokens == full.x_tandem["tokens"]
    assert full.stop_reason in ("max_tokens", "end_turn")

    raw_stream = client.messages.create(model="tiny", max_tokens=20, system="w9 w10", stream=True,
                                        messages=[{"role": "user", "content": "w5 w6 w7 w8"}])
    events = list(raw_stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == full.content[0].text
    delta = events[-2]
    assert delta.usage.output_tokens == full.usage.output_tokens and delta.x_tandem["mode"] == full.x_tandem["mode"]
    count = client.messages.count_tokens(model="tiny", system="w9 w10",
                                         messages=[{"role": "user", "content": "w5 w6 w7 w8"}])
    # Anthropic counts prompt tokens read from a cache apart from input_tokens
    assert count.input_tokens == full.usage.input_tokens + full.usage.cache_read_input_tokens


# -- tools, reasoning, stops (scripted model) ---------------------------------------------------

def test_openai_tool_call_round_trip(scripted):
    client = oai(scripted, KEY)
    msgs = [{"role": "user", "content": "What is the weather"}]
    r = client.chat.completions.create(model="s", messages=msgs, tools=TOOLS_OAI, max_tokens=50)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model="s", messages=msgs, tools=TOOLS_OAI, max_tokens=50, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    history = msgs + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = client.chat.completions.create(model="s", messages=history, tools=TOOLS_OAI, max_tokens=50)
    assert r2.choices[0].message.content == "It's warm in Paris." and r2.choices[0].finish_reason == "stop"
    # The earlier call was rendered back into the prompt with the model's own template.
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 5


def test_anthropic_tool_use_round_trip(scripted):
    client = ant(scripted, KEY)
    msgs = [{"role": "user", "content": "what is the weather"}]
    m = client.messages.create(model="s", max_tokens=50, tools=TOOLS_ANT, messages=msgs)
    assert m.stop_reason == "tool_use"
    (block,) = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}

    with client.messages.stream(model="s", max_tokens=50, tools=TOOLS_ANT, messages=msgs) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Paris"})]

    history = msgs + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]}]
    m2 = client.messages.create(model="s", max_tokens=50, tools=TOOLS_ANT, messages=history)
    assert m2.stop_reason == "end_turn" and [b.text for b in m2.content] == ["It's warm in Paris."]


def test_claude_code_shaped_request(scripted):
    """What Claude Code sends: ?beta=true, system blocks with cache_control, a thinking budget,
    metadata, earlier thinking blocks and a tool result holding an image."""
    body = {
        "model": "claude-sonnet-4-5", "max_tokens": 64, "stream": True, "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "tool_choice": {"type": "auto"},
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "tools": TOOLS_ANT + [{"type": "web_search_20250305", "name": "web_search"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "s"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                {"type": "text", "text": "weather"}]}]},
        ]}
    conn = http.client.HTTPConnection(scripted.host, scripted.port, timeout=30)
    conn.request("POST", "/v1/messages?beta=true", json.dumps(body),
                 {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"})
    got = sse_events(conn.getresponse(), until=lambda ev: ev[-1][0] == "message_stop")
    conn.close()
    data = {k: json.loads(d) for k, d in got if k in ("content_block_start", "content_block_delta", "message_delta")}
    assert data["content_block_start"]["content_block"]["name"] == "get_weather"
    assert json.loads(data["content_block_delta"]["delta"]["partial_json"]) == {"city": "Paris"}
    assert data["message_delta"]["delta"]["stop_reason"] == "tool_use"
    assert [i.split(" ")[0] for i in data["message_delta"]["x_tandem"]["ignored"]] == [
        "tools[1]", "thinking.budget_tokens", "thinking"]


def test_bare_json_tool_call_and_tools_off(scripted):
    client = oai(scripted, KEY)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model="s", messages=[{"role": "user", "content": "clock"}], tools=tools)
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [("get_time", "{}")]
    # Without tools the same output is plain text.
    r = client.chat.completions.create(model="s", messages=[{"role": "user", "content": "clock"}])
    assert r.choices[0].message.content == '{"name":"get_time", "arguments":{}}' and not r.choices[0].message.tool_calls


def test_reasoning_lifted_in_both_dialects(scripted):
    r = oai(scripted, KEY).chat.completions.create(model="s", messages=[{"role": "user", "content": "ponder"}])
    msg = r.choices[0].message
    assert msg.content == "Answer: 42" and msg.model_extra["reasoning_content"] == "hmm, easy."
    chunks = list(oai(scripted, KEY).chat.completions.create(
        model="s", messages=[{"role": "user", "content": "ponder"}], stream=True))
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices) == "hmm, easy."
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Answer: 42"

    client = ant(scripted, KEY)
    m = client.messages.create(model="s", max_tokens=50, messages=[{"role": "user", "content": "ponder"}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "hmm, easy."), ("text", "Answer: 42")]
    with client.messages.stream(model="s", max_tokens=50, messages=[{"role": "user", "content": "ponder"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Answer: 42"


def test_stop_sequences(scripted):
    r = oai(scripted, KEY).chat.completions.create(model="s", messages=[{"role": "user", "content": "recite"}],
                                                   stop=["gamma", "epsilon"])
    assert r.choices[0].message.content.strip() == "alpha beta" and r.choices[0].finish_reason == "stop"
    assert r.x_tandem["tokens"] == 3  # generation stopped at the token that completed the stop string
    client = ant(scripted, KEY)
    for stream in (False, True):
        if stream:
            with client.messages.stream(model="s", max_tokens=50, stop_sequences=["epsilon", "delta"],
                                        messages=[{"role": "user", "content": "recite"}]) as s:
                m = s.get_final_message()
        else:
            m = client.messages.create(model="s", max_tokens=50, stop_sequences=["epsilon", "delta"],
                                       messages=[{"role": "user", "content": "recite"}])
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == "delta"
        assert m.content[0].text.strip() == "alpha beta gamma"
    m = client.messages.create(model="s", max_tokens=50, messages=[{"role": "user", "content": "recite"}])
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and m.content[0].text == "alpha beta gamma delta epsilon"


# -- auth, errors, limits -----------------------------------------------------------------------

def test_api_key_guards_every_route_but_health(scripted):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        oai(scripted, "wrong").chat.completions.create(model="s", messages=msgs)
    with pytest.raises(anthropic.AuthenticationError, match="invalid API key"):
        ant(scripted, "wrong").messages.create(model="s", max_tokens=5, messages=msgs)
    assert raw(scripted, "GET", "/health")[0] == 200
    for path in ("/metrics", "/events", "/v1/models"):
        assert raw(scripted, "GET", path)[0] == 401
    status, body = raw(scripted, "POST", "/v1/messages", {"model": "s", "max_tokens": 5, "messages": msgs},
                       {"x-api-key": KEY})
    assert status == 200 and body["content"][0]["text"] == "Hello there, friend."
    status, body = raw(scripted, "POST", "/v1/chat/completions", {"messages": msgs}, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["choices"][0]["message"]["content"] == "Hello there, friend."


@pytest.mark.parametrize("path,body,fragment,param", [
    ("/v1/chat/completions", b"{not json", "not valid JSON", None),
    ("/v1/chat/completions", b"[1, 2]", "JSON object", None),
    ("/v1/chat/completions", {"messages": []}, "'messages' must be a non-empty list", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "unknown role", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     "'temperature' must be a number", "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     "'max_tokens' must be at least 1", "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "'stop' must be", "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tandem": {"mode": "warp"}},
     "'tandem.mode' must be one of", "tandem.mode"),
    ("/v1/completions", {"prompt": ""}, "'prompt' must be a non-empty string", "prompt"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is required", None),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "an image block needs a 'source'", None),
])
def test_malformed_requests_get_400_in_the_dialect(tiny, path, body, fragment, param):
    status, err = raw(tiny, "POST", path, body)
    assert status == 400
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert fragment in err["error"]["message"]
    else:
        assert err["error"]["type"] == "invalid_request_error" and fragment in err["error"]["message"]
        assert err["error"]["param"] == param


def test_sdk_errors_and_long_prompt(tiny):
    with pytest.raises(openai.BadRequestError, match="'top_p' must be between 0 and 1"):
        oai(tiny).chat.completions.create(model="t", messages=[{"role": "user", "content": "w5"}], top_p=3)
    long = " ".join(f"w{5 + i % 80}" for i in range(600))  # 600 tokens > --max-context 512
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens") as e:
        oai(tiny).chat.completions.create(model="t", messages=[{"role": "user", "content": long}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 512 maximum"):
        ant(tiny).messages.create(model="t", max_tokens=5, messages=[{"role": "user", "content": long}])
    # max_tokens beyond the context is clipped to what fits
    r = oai(tiny).completions.create(model="t", prompt=" ".join(["w7"] * 500), max_tokens=100)
    assert r.usage.completion_tokens <= 12 and r.choices[0].finish_reason in ("length", "stop")
    status, body = raw(tiny, "GET", "/v1/nothing")
    assert status == 404 and "no route" in body["error"]["message"]
    assert raw(tiny, "GET", "/health")[0] == 200


def test_failed_load_is_reported_not_fatal():
    def broken():
        from engine.errors import TandemError
        raise TandemError("/models/x.gguf: truncated (needs 10 bytes, has 4)")

    srv = make_server(broken, port=0).start()
    try:
        with pytest.raises(Exception, match="truncated"):
            srv.wait_ready(30)
        assert raw(srv, "GET", "/health") == (503, {"status": "error", "error": "/models/x.gguf: truncated (needs 10 bytes, has 4)"})
        with pytest.raises(openai.InternalServerError, match="the model failed to load: /models/x.gguf: truncated"):
            oai(srv).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    finally:
        srv.stop()


# -- cancellation, keep-alive, events -----------------------------------------------------------

def _open_events(srv) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    conn.request("GET", "/events", headers={"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline() == b": connected\n"
    return resp


def _metric(srv, name: str) -> float:
    _, text = raw(srv, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def _stream_count(srv, max_tokens: int = 200_000, stream: bool = True) -> http.client.HTTPConnection:
    """Start the scripted model counting forever (baseline mode) on a raw connection."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    body = {"prompt": "count", "max_tokens": max_tokens, "stream": stream, "tandem": {"mode": "baseline"}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    return conn


def _hang_up(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def _wait_result(events, deadline_s: float = 20) -> dict | None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for kind, data in sse_events(events, until=lambda ev: ev[-1][0] == "result", limit=5000):
            if kind == "result":
                return json.loads(data)
    return None


def _wait_decoding(events) -> str:
    """The id of the next generation, once it is decoding (its first round is published): past the
    queue and the prefill, where a client's hang-up must cancel it with a result."""
    got = sse_events(events, until=lambda ev: ev[-1][0] == "round")
    started = [json.loads(d)["id"] for k, d in got if k == "request"]
    assert got and got[-1][0] == "round" and started, got
    assert json.loads(got[-1][1])["id"] == started[-1]
    return started[-1]


def test_client_disconnect_cancels_generation(scripted):
    events = _open_events(scripted)
    cancelled_before = _metric(scripted, "tandem_generations_cancelled_total")
    conn = _stream_count(scripted)
    got = sse_events(conn.getresponse(), until=lambda ev: len(ev) >= 5)
    assert [json.loads(d)["choices"][0]["text"] for _, d in got[:3]] == ["one", " two", " three"]
    _hang_up(conn)
    result = _wait_result(events)
    assert result is not None and result["finish_reason"] == "cancelled"
    assert 5 <= result["tokens"] < 200_000 and result["mode"] == "baseline"

    # A non-streamed request is cancelled too when its client hangs up while waiting.
    conn = _stream_count(scripted, stream=False)
    waiting = _wait_decoding(events)  # not a sleep: under load the request may still be queued
    _hang_up(conn)
    result = _wait_result(events)
    assert result is not None and result["id"] == waiting
    assert result["finish_reason"] == "cancelled" and result["tokens"] < 200_000
    events.close()
    assert _metric(scripted, "tandem_generations_cancelled_total") == cancelled_before + 2
    # still healthy and serving
    assert raw(scripted, "GET", "/health")[1]["status"] == "ok"
    assert oai(scripted, KEY).chat.completions.create(
        model="s", messages=[{"role": "user", "content": "recite"}]).choices[0].message.content.startswith("alpha")


def test_events_stream_rounds_and_result(scripted):
    events = _open_events(scripted)
    r = oai(scripted, KEY).chat.completions.create(model="s", messages=[{"role": "user", "content": "recite"}],
                                                   extra_body={"tandem": {"mode": "lookup", "max_draft": 4}})
    got = sse_events(events, until=lambda ev: ev[-1][0] == "result")
    events.close()
    mine = [(k, json.loads(d)) for k, d in got if k in ("request", "round", "result") and json.loads(d)["id"] == r.id]
    assert mine[0][0] == "request" and mine[-1][0] == "result"
    rounds = [e for k, e in mine if k == "round"]
    assert sum(e["committed"] for e in rounds) == r.x_tandem["tokens"] == 5
    assert all(e["mode"] == "lookup" and e["cap"] <= 4 for e in rounds)
    assert {k: v for k, v in mine[-1][1].items() if k not in ("type", "id")} == {
        k: v for k, v in r.x_tandem.items() if k not in ("ttft_s", "queue_s")}


def test_keepalive_while_queued_then_answer(scripted):
    """A streamed request waiting behind a running generation gets keep-alives, then its answer."""
    busy = _stream_count(scripted)
    sse_events(busy.getresponse(), until=lambda ev: len(ev) >= 2)  # the engine is now busy
    conn = http.client.HTTPConnection(scripted.host, scripted.port, timeout=30)
    conn.request("POST", "/v1/messages", json.dumps({"max_tokens": 20, "stream": True, "messages": [
        {"role": "user", "content": "recite"}]}), {"x-api-key": KEY})
    resp = conn.getresponse()
    first = sse_events(resp, until=lambda ev: [k for k, _ in ev].count("ping") >= 2)
    _hang_up(busy)  # frees the engine
    rest = sse_events(resp, until=lambda ev: ev[-1][0] == "message_stop")
    conn.close()
    kinds = [k for k, _ in first + rest]
    assert kinds[:3] == ["message_start", "ping", "ping"] and kinds[-1] == "message_stop"
    text = "".join(json.loads(d)["delta"]["text"] for k, d in rest if k == "content_block_delta")
    assert text == "alpha beta gamma delta epsilon"


# -- prompt rendering (no server) ---------------------------------------------------------------

SMOLLM2_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOL_HISTORY = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


def test_render_tools_for_template_without_tool_syntax():
    tok = make_tokenizer()
    tok._tokenizer.chat_template = SMOLLM2_TEMPLATE
    text, ids = render_chat(tok, TOOL_HISTORY, TOOLS_OAI)
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOLS_OAI[0]) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n") and ids == tok.encode(text, add_special_tokens=False)
    # No template at all: the same turns in ChatML text.
    plain, _ = render_chat(make_tokenizer(), TOOL_HISTORY, TOOLS_OAI)
    assert plain == text


def test_render_tools_natively_when_template_has_them():
    eng = make_scripted_engine()
    text, _ = render_chat(eng.tokenizer, TOOL_HISTORY, TOOLS_OAI)
    assert text.startswith("tool:get_weather ")
    assert '<tool_call> get_weather {"city": "Paris"} </tool_call>' in text and text.rstrip().endswith("sunny")


@pytest.mark.parametrize("pieces", [["<think>a b</think>\n\nHi <tool_call>", '{"name": "f", "arguments": {"x": 1}}',
                                     "</tool_call>"], ["<", "thi", "nk>a b</", "think>Hi <", "tool_", "call>{\"name\":",
                                                       " \"f\", \"arguments\": {\"x\": 1}}</tool", "_call>"]])
def test_output_parser_handles_tags_split_across_chunks(pieces):
    p = OutputParser(tool_names=["f"])
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    merged: list = []
    for kind, payload in events:
        if merged and kind == merged[-1][0] != "tool":
            merged[-1] = (kind, merged[-1][1] + payload)
        else:
            merged.append((kind, payload))
    assert [(k, v if k != "tool" else (v.name, v.arguments)) for k, v in merged] == [
        ("thinking", "a b"), ("text", "Hi "), ("tool", ("f", {"x": 1}))]


def test_output_parser_keeps_broken_tool_call_as_text_and_opens_in_think():
    p = OutputParser(tool_names=["f"])
    assert p.feed("<tool_call>not json</tool_call> ok") + p.finish() == [("text", "<tool_call>not json</tool_call> ok")]
    p = OutputParser(in_think=True)  # the template opened <think> in the generation prompt
    assert p.feed("plan</think>answer") + p.finish() == [("thinking", "plan"), ("text", "answer")]


# -- CLI ----------------------------------------------------------------------------------------

def test_serve_and_claude_cli(scripted, capfd, tmp_path, monkeypatch):
    from engine.cli import claude
    from engine.cli import build_parser, main

    monkeypatch.setenv("HOME", str(tmp_path))  # no Claude Code settings file of this machine's user
    monkeypatch.delenv("CLAUDE_CONFIG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)

    args = build_parser("serve").parse_args(["serve", "--port", "0", "--api-key", "k", "--mode", "lookup",
                                             "--max-draft", "auto", "--max-context", "100", "--model", "x"])
    assert (args.port, args.api_key, args.mode, args.max_draft, args.max_context) == (0, "k", "lookup", "auto", 100)

    port = str(scripted.port)
    assert main(["claude", "--port", port, "--api-key", KEY, "--print-env"]) == 0
    out = capfd.readouterr().out
    assert f"export ANTHROPIC_BASE_URL=http://127.0.0.1:{port}" in out and "export ANTHROPIC_MODEL=scripted" in out
    assert f"export ANTHROPIC_AUTH_TOKEN={KEY}" in out
    assert main(["claude", "--port", port, "--print-env"]) == 1  # wrong key: says so
    assert "wants an API key" in capfd.readouterr().err

    assert main(["claude", "--port", port, "--claude", "no-such-claude-binary"]) == 1
    assert "'no-such-claude-binary' is not on PATH" in capfd.readouterr().err

    # The variables reach the child only.
    before = dict(os.environ)
    code = "import os,sys; print(os.environ['ANTHROPIC_BASE_URL'], os.environ['ANTHROPIC_MODEL'], sys.argv[1:])"
    assert main(["claude", "--port", port, "--api-key", KEY, "--claude", sys.executable, "--", "-c", code, "go"]) == 0
    assert f"http://127.0.0.1:{port} scripted ['go']" in capfd.readouterr().out
    assert dict(os.environ) == before
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    unused = free.getsockname()[1]
    free.close()
    assert claude.run(build_parser("claude").parse_args(["claude", "--port", str(unused), "--model", "m",
                                                          "--print-env"])) == 0
    with pytest.raises(Exception, match="no tandem server at"):
        claude.served_model(f"http://127.0.0.1:{unused}", None, timeout=2)


def test_output_parser_streamed_thinking_has_no_trailing_whitespace():
    p = OutputParser()
    events = [e for piece in ["<think>", "plan", "\n", "\n", "</think>", "\n\n", "Done", "."] for e in p.feed(piece)]
    assert events + p.finish() == [("thinking", "plan"), ("text", "Done"), ("text", ".")]


@pytest.mark.parametrize("max_batch", [1, 3])  # one request at a time, and batched: two loops
def test_no_request_waits_for_a_calibration_the_server_measures_it_between_requests(max_batch, tmp_path, monkeypatch,
                                                                                    caplog):
    """On a machine with no calibration of the model, ``--max-draft auto`` requests draft at the
    mode's fixed cap and say why, while the server measures the calibration whenever it is idle;
    a request that arrives meanwhile stops the measurement (it starts again when the server is
    idle) and is answered at once. Once measured, auto requests use it."""
    import logging

    from engine import calibrate

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    measuring = threading.Event()
    real_measure = calibrate.measure

    def measure(*args, progress=None, **kwargs):
        measuring.set()
        return real_measure(*args, progress=progress, **kwargs)

    monkeypatch.setattr(calibrate, "measure", measure)
    srv = make_server(lambda: make_tiny_engine("llama", seed=0, scale=4.0), port=0, max_context=512,
                      max_batch=max_batch, calibrate_while_idle=True).start()  # as tandem serve
    try:
        client = oai(srv.wait_ready(60))
        ask = {"tandem": {"mode": "lookup", "max_draft": "auto"}}
        with caplog.at_level(logging.INFO, logger="tandem.server"):
            assert measuring.wait(60)  # the server's own mode (auto), as soon as it is idle
            first = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, extra_body=ask)
            assert isinstance(first.x_tandem["cap"], int) and "not calibrated" in first.x_tandem["note"]
            messages = lambda: [r.getMessage() for r in caplog.records]  # noqa: E731
            assert any("paused for a request" in m for m in messages())
            deadline = time.monotonic() + 120
            while not any("calibrated mode lookup" in m for m in messages()) and time.monotonic() < deadline:
                time.sleep(0.2)
            later = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, extra_body=ask)
            assert later.x_tandem["cap"] == "auto" and not later.x_tandem["note"]
            assert any("calibrated mode auto" in m for m in messages())
            assert not any("a request's --max-draft auto" in m for m in messages())  # nobody measured inline
    finally:
        srv.stop()


def test_a_seeded_auto_request_measures_its_calibration_so_its_sample_never_depends_on_it(tmp_path, monkeypatch):
    """A seeded request's caps, and so its sample, come from the calibration: where the server
    measures calibrations between requests, a seeded ``--max-draft auto`` request still measures
    its own first instead of drafting at a fixed cap, and gives the same tokens every time."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    srv = make_server(lambda: make_tiny_engine("llama", seed=0, scale=4.0), port=0, max_context=512,
                      calibrate_while_idle=True).start()
    try:
        client = oai(srv.wait_ready(60))
        ask = dict(model="tiny", messages=CHAT, max_tokens=12, temperature=0.9, seed=7,
                   extra_body={"tandem": {"mode": "lookup", "max_draft": "auto"}})
        first = client.chat.completions.create(**ask)
        assert first.x_tandem["cap"] == "auto" and not first.x_tandem["note"]
        again = client.chat.completions.create(**ask)
        assert again.choices[0].message.content == first.choices[0].message.content
    finally:
        srv.stop()
