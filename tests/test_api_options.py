"""Logprobs, penalties, logit_bias and the thinking switch through the API server, with the real
openai and anthropic SDKs.

The server runs a tiny random qwen3 whose word-level tokenizer carries a Qwen3-like chat
template: it reads ``enable_thinking`` (false: an empty ``<think> </think>`` block after the
generation prompt) and drops earlier turns' reasoning, as Qwen3's does. A second server runs
the tests' plain tiny llama, whose tokenizer has no template (no thinking switch).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from engine.generate import Engine
from engine.processors import Processing
from engine.serve.server import make_server
from tests.test_processors import clean_rows, log_softmax
from tests.test_server import ant, oai, raw
from tests.tiny import make_tiny_model, make_tokenizer

QWEN3_LIKE = (
    "{%- for m in messages %}{{- '<|im_start|> ' + m.role + ' ' }}"
    "{%- if m.role == 'assistant' %}{{- m.content.split('</think>')[-1] }}{%- else %}{{- m.content }}{%- endif %}"
    "{{- ' <|im_end|> ' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|> assistant ' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think> </think> ' }}{%- endif %}"
    "{%- endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "user", "assistant", "system"]


def thinking_tokenizer() -> TokenizerWrapper:
    fast = make_tokenizer()._tokenizer
    fast.add_tokens(SPECIALS)
    fast.chat_template = QWEN3_LIKE
    return TokenizerWrapper(fast)  # after the think tokens exist: mlx-lm reads them when it wraps


def thinking_engine() -> Engine:
    tok = thinking_tokenizer()
    return Engine(make_tiny_model("qwen3", seed=2, vocab=len(tok._tokenizer), scale=3.0), tok, name="tiny-think")


@pytest.fixture(scope="module")
def think():
    srv = make_server(thinking_engine, port=0, max_context=4096).start()
    yield srv.wait_ready(60)
    srv.stop()


@pytest.fixture(scope="module")
def plain():
    srv = make_server(lambda: Engine(make_tiny_model("llama", seed=0, scale=4.0), make_tokenizer(), name="tiny"),
                      port=0, max_context=512, thinking=False).start()
    yield srv.wait_ready(60)
    srv.stop()


MESSAGES = [{"role": "user", "content": "w5 w6 w7 w8 w5 w6 w7"}]


# -- logprobs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_chat_logprobs_parse_in_the_sdk_and_equal_the_clean_forward(think, mode):
    engine = think.worker.engine
    client = oai(think)
    kw = dict(model="t", messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=3, presence_penalty=0.5,
              extra_body={"tandem": {"mode": mode}, "repetition_penalty": 1.2})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    ids = engine.encode(MESSAGES)
    tokens = [engine.tokenizer._tokenizer.convert_tokens_to_ids(c.token) for c in content]
    assert len(content) == r.usage.completion_tokens == r.x_tandem["tokens"]
    want = log_softmax(clean_rows(engine.model, ids, tokens, Processing(presence_penalty=0.5, repetition_penalty=1.2)))
    for i, c in enumerate(content):
        assert isinstance(c.logprob, float) and c.bytes == list(c.token.encode())
        assert c.logprob == pytest.approx(want[i, tokens[i]], abs=2e-4)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(np.sort(want[i])[::-1][:3], abs=2e-4)
    streamed = list(client.chat.completions.create(stream=True, **kw))
    got = [c for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
           for c in chunk.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in got] == [(c.token, round(c.logprob, 4)) for c in content]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content


def test_completion_logprobs_legacy_shape(think):
    client = oai(think)
    r = client.completions.create(model="t", prompt="w5 w6 w7", max_tokens=8, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for i, top in enumerate(lp.top_logprobs):  # greedy: the chosen token is the most likely one
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model="t", prompt="w5 w6 w7", max_tokens=8, logprobs=2, stream=True))
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    none = client.completions.create(model="t", prompt="w5 w6 w7", max_tokens=3)
    assert none.choices[0].logprobs is None


@pytest.mark.parametrize("path,body,fragment,param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true", "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be between 0 and 20",
     "top_logprobs"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "'presence_penalty' must be between -2 and 2", "presence_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "'repetition_penalty' must be greater than 0",
     "repetition_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "'logit_bias' keys must be token ids", "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "values must be numbers between -100 and 100",
     "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"99999": 1}}, "not in the vocabulary", "logit_bias"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "cannot set \"messages\"",
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"enable_thinking": "no"}, "'enable_thinking' must be true or false", "enable_thinking"),
    ("/v1/completions", {"prompt": "w5", "logprobs": 2, "echo": True}, "'logprobs' with 'echo'", "logprobs"),
])
def test_bad_options_get_400_naming_the_field(think, path, body, fragment, param):
    if path.endswith("chat/completions"):
        body = {"messages": MESSAGES, **body}
    status, err = raw(think, "POST", path, body)
    assert status == 400, err
    assert fragment in err["error"]["message"] and err["error"]["param"] == param


# -- penalties and bias --------------------------------------------------------------------------

def test_penalties_change_the_output_and_lookup_still_equals_baseline(think):
    client = oai(think)

    def ask(mode, **kw):
        r = client.chat.completions.create(model="t", messages=MESSAGES, max_tokens=30,
                                           extra_body={"tandem": {"mode": mode}, **kw.pop("extra", {})}, **kw)
        return r.choices[0].message.content, r.x_tandem

    plain, _ = ask("baseline")
    for kw in (dict(frequency_penalty=1.5), dict(extra={"repetition_penalty": 1.5})):
        base, _ = ask("baseline", **kw)
        spec, stats = ask("lookup", **kw)
        assert base != plain and spec == base
        assert "ignored" not in stats
    banned = max(set(plain.split()), key=plain.split().count)
    token = think.worker.engine.tokenizer._tokenizer.convert_tokens_to_ids(banned)
    for mode in ("baseline", "lookup"):
        text, _ = ask(mode, logit_bias={str(token): -100})
        assert banned not in text.split()
    msg = ant(think).messages.create(model="t", max_tokens=30, messages=MESSAGES,
                                     extra_body={"frequency_penalty": 1.5, "tandem": {"mode": "lookup"}})
    assert msg.content[0].text == ask("baseline", frequency_penalty=1.5)[0]


# -- thinking switch ------------------------------------------------------------------------------

def test_thinking_switch_in_both_dialects(think):
    engine = think.worker.engine

    def prompt_tokens(path, **extra):
        body = {"messages": MESSAGES, "max_tokens": 1, **extra}
        status, reply = raw(think, "POST", path, body)
        assert status == 200, reply
        usage = reply["usage"]
        n = usage["prompt_tokens"] if "prompt_tokens" in usage else usage["input_tokens"] + usage["cache_read_input_tokens"]
        return n, reply["x_tandem"]

    on = len(engine.encode(MESSAGES))
    off = len(engine.encode(MESSAGES, template_kwargs={"enable_thinking": False}))
    assert off == on + 2  # <think> </think>
    for path, extra, want in [
        ("/v1/chat/completions", {}, on),
        ("/v1/chat/completions", {"enable_thinking": False}, off),
        ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}, off),
        ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": True}}, on),
        ("/v1/messages", {"thinking": {"type": "disabled"}}, off),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 512}}, on),
    ]:
        n, x = prompt_tokens(path, **extra)
        assert n == want, (path, extra)
        assert not [i for i in x.get("ignored", []) if i.startswith("thinking ")]
    _, x = prompt_tokens("/v1/chat/completions", chat_template_kwargs={"reasoning_level": "low"})
    assert x["ignored"] == ["chat_template_kwargs.reasoning_level (this model's chat template does not read it)"]


def test_a_template_without_the_switch_reports_it_ignored(plain):
    status, reply = raw(plain, "POST", "/v1/chat/completions",
                        {"messages": MESSAGES, "max_tokens": 1, "enable_thinking": False})
    assert status == 200 and reply["x_tandem"]["ignored"] == [
        "thinking (this model's chat template has no enable_thinking switch)"]
    status, reply = raw(plain, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert "ignored" not in reply["x_tandem"]  # the server-wide --no-thinking is not the request's doing
    m = ant(plain).messages.create(model="t", max_tokens=1, messages=MESSAGES, thinking={"type": "disabled"})
    assert m.x_tandem["ignored"][0].startswith("thinking ")


def test_server_wide_no_thinking_is_the_default_a_request_can_override():
    srv = make_server(thinking_engine, port=0, max_context=4096, thinking=False).start()
    try:
        srv.wait_ready(60)
        engine = srv.worker.engine
        off = len(engine.encode(MESSAGES, template_kwargs={"enable_thinking": False}))
        client = oai(srv)
        assert client.chat.completions.create(model="t", messages=MESSAGES, max_tokens=1).usage.prompt_tokens == off
        r = client.chat.completions.create(model="t", messages=MESSAGES, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert r.usage.prompt_tokens == off - 2
    finally:
        srv.stop()


# -- tandem claude --print-settings ---------------------------------------------------------------

def test_claude_print_settings_is_a_settings_local_json_block(think, capfd, monkeypatch, tmp_path):
    from engine.cli import main

    monkeypatch.setenv("CLAUDE_CODE_USE_BEDROCK", "1")  # a provider switch in this shell: emptied in the file
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert main(["claude", "--port", str(think.port), "--print-settings"]) == 0
    captured = capfd.readouterr()
    env = json.loads(captured.out)["env"]
    assert env["ANTHROPIC_BASE_URL"] == think.url and env["ANTHROPIC_MODEL"] == "tiny-think"
    assert env["ANTHROPIC_AUTH_TOKEN"] == "tandem-local" and env["ANTHROPIC_API_KEY"] == ""
    assert env["CLAUDE_CODE_USE_BEDROCK"] == "" and "127.0.0.1" in env["NO_PROXY"].split(",")
    assert "HTTPS_PROXY" not in env and "settings.local.json" in captured.err and "API key" not in captured.err
    key_file = tmp_path / "key"
    key_file.write_text("sk-local\n")
    assert main(["claude", "--port", str(think.port), "--model", "m", "--api-key-file", str(key_file),
                 "--print-settings"]) == 0
    captured = capfd.readouterr()
    env = json.loads(captured.out)["env"]
    assert env["ANTHROPIC_AUTH_TOKEN"] == "sk-local" and env["ANTHROPIC_MODEL"] == "m"
    assert "holds the server's API key" in captured.err


# -- the prefix cache across turns with thinking off ----------------------------------------------

def _two_turns(run, first: list[dict]) -> tuple[object, object, list[dict]]:
    r1 = run(first)
    second = first + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "w9 w10 w11"}]
    return r1, run(second), second


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])  # trimmable caches; recurrent + full attention (no trimming)
def test_next_turn_restores_everything_before_the_empty_think_block(arch):
    """With thinking off the generation prompt ends in ``<think> </think>``, which the next turn's
    history does not have: the next turn can restore at most up to there. A cache that cannot be
    cut back needs a snapshot at exactly that point (without it the hybrid restored nothing)."""
    tok = thinking_tokenizer()
    model = make_tiny_model(arch, seed=2, vocab=len(tok._tokenizer), scale=3.0)
    first = [{"role": "user", "content": "w5 w6 w7 " * 20}]
    off = {"enable_thinking": False}
    cached, fresh = Engine(model, tok), Engine(model, tok)
    fresh.configure_prefix_cache(False)

    def run(engine):
        return lambda m: engine.generate(m, max_new_tokens=10, mode="baseline", template_kwargs=off)

    r1, r2, second = _two_turns(run(cached), first)
    prompt1 = cached.encode(first, template_kwargs=off)
    assert prompt1[-2:] == tok._tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert r2.cached_tokens == len(prompt1) - 2
    assert r2.token_ids == run(fresh)(second).token_ids  # restored or not, the same answer
    r3 = cached.generate(second, max_new_tokens=10, mode="baseline", template_kwargs=off)
    assert r3.cached_tokens == len(cached.encode(second, template_kwargs=off))  # the same prompt again: all of it


def test_server_turns_with_thinking_off_hit_the_prefix_cache():
    srv = make_server(lambda: Engine(make_tiny_model("qwen3_5", seed=2, vocab=103, scale=3.0), thinking_tokenizer(),
                                     name="hybrid"), port=0, max_context=4096, thinking=False).start()
    try:
        srv.wait_ready(60)
        client = oai(srv)

        def run(messages):
            r = client.chat.completions.create(model="t", messages=messages, max_tokens=10)
            r.text = r.choices[0].message.content or ""
            return r

        first = [{"role": "user", "content": "w5 w6 w7 " * 20}]
        r1, r2, _ = _two_turns(run, first)
        assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens - 2
    finally:
        srv.stop()


def test_cli_generate_with_penalties_logprobs_and_no_thinking(capsys):
    from engine.cli import main

    assert main(["generate", "--mode", "lookup", "--prompt", "Say hello.", "--max-new-tokens", "6", "--logprobs", "2",
                 "--presence-penalty", "0.5", "--repetition-penalty", "1.1", "--logit-bias", "28:-100",
                 "--no-thinking", "--json"]) == 0
    out = capsys.readouterr()
    assert "chat template has no enable_thinking switch" in out.err  # the starter's ChatML template
    lines = [line for line in out.err.splitlines() if " | " in line and line.startswith(("'", '"'))]
    assert len(lines) == json.loads(out.out.splitlines()[-1])["tokens"]
    assert all(len(line.split(" | ")[1].split("=")) == 3 for line in lines)  # two alternatives each
