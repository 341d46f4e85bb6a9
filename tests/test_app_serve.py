"""The app's local server switch under pytest-qt (offscreen): the OpenAI SDK against the app's
own engine thread on 127.0.0.1, while the user's chat decodes in the same batch.

The worker runs the tiny chat llama of tests/test_app_chat.py (a chat template; its EOS is
never picked, so every request runs to its max_tokens)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager

import anthropic
import openai
import pytest

from app.main import MainWindow
from tests.test_app_chat import ChatEngine
from tests.test_app_hub import build_cache

WAIT_MS = 30_000
CHAT = "w5 w6 w7 w8 w5 w6 w7"
AGENT = [{"role": "user", "content": "w20 w21 w22 w20 w21 w22 w20"}]


class Named(ChatEngine):
    """The tiny chat llama named by the spec it was loaded as: loading another spec gives another
    model (same weights), told apart by its name and the prompts it encoded."""

    def __init__(self, name: str):
        super().__init__()
        self.name = self.target.name = name


SLOW = threading.Event()  # "org/slow" loads once this is set
MADE: list[Named] = []


def factory(spec, drafter):
    if spec == "org/slow":
        assert SLOW.wait(30)
    MADE.append(Named(spec or "tiny-chat"))
    return MADE[-1]


@pytest.fixture
def make_win(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "tandem"))
    made: list[MainWindow] = []
    cache = str(build_cache(tmp_path))

    def make() -> MainWindow:
        w = MainWindow(engine_factory=factory, cache_dir=cache)
        qtbot.addWidget(w)
        made.append(w)
        qtbot.waitUntil(lambda: w.chat.model_ready, timeout=WAIT_MS)
        return w

    yield make
    for w in made:
        w.shutdown()
        assert not w.host.thread.isRunning()


@pytest.fixture
def win(make_win):
    return make_win()


def switch(qtbot, win, on: bool) -> dict:
    panel = win.models.serve_panel
    with qtbot.waitSignal(win.bridge.serving_changed, timeout=WAIT_MS,
                          check_params_cb=lambda state: state.get("on") == on) as sig:
        if on:
            panel.port.setValue(0)  # any free port
        panel.set_on(on)
    return sig.args[0]


def client(state: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=state["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


class Stream(threading.Thread):
    """One streamed chat completion through the OpenAI SDK, read in this thread."""

    def __init__(self, state: dict, max_tokens: int):
        super().__init__(daemon=True)
        self.api, self.max_tokens = client(state), max_tokens
        self.first = threading.Event()
        self.pieces: list[str] = []
        self.finish: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for chunk in self.api.chat.completions.create(model="tiny", messages=AGENT, max_tokens=self.max_tokens,
                                                          temperature=0, stream=True,
                                                          extra_body={"tandem": {"mode": "baseline"}}):
                for choice in chunk.choices:
                    self.pieces.append(choice.delta.content or "")
                    self.finish = choice.finish_reason or self.finish
                if self.text:  # the first token's text (the role chunk before it says nothing)
                    self.first.set()
        except BaseException as err:  # reported by the test
            self.error = err
        finally:
            self.first.set()

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def result(self, qtbot) -> str:
        qtbot.waitUntil(lambda: not self.is_alive(), timeout=WAIT_MS)
        assert self.error is None, self.error
        return self.text


@contextmanager
def held(serving, release):
    """The shared batch stands still once each of its requests has its first token, until
    ``release()`` (read in the worker thread): what must overlap does, however loaded the CPU."""
    batcher = serving.batcher
    step = batcher.step
    batcher.step = lambda: step() if release() or not all(t.output.tokens for t in batcher.tickets) else None
    try:
        yield
    finally:
        batcher.step = step


def chat(qtbot, win, max_tokens: int, text: str = CHAT) -> dict:
    c = win.chat
    c.new_chat()  # the same one-message prompt each time
    c.mode.setCurrentText("lookup")
    c.temperature.setValue(0.0)
    c.max_tokens.setValue(max_tokens)
    with qtbot.waitSignal(win.bridge.gen_finished, timeout=WAIT_MS) as sig:
        assert c.send(text) is not None
    qtbot.waitUntil(lambda: not c.generating, timeout=WAIT_MS)
    return sig.args[1]


def get(state: dict, path: str, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", state["port"], timeout=10)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def health(state: dict) -> tuple[int, dict]:
    return get(state, "/health")


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_server_and_chat_share_one_batch_and_switch_off_lets_requests_finish(win, qtbot):
    state = switch(qtbot, win, True)
    assert state["url"].startswith("http://127.0.0.1:") and state["port"] > 0
    # alone: the text each gets by itself
    agent_alone = Stream(state, 120)
    agent_alone.start()
    agent_alone = agent_alone.result(qtbot)
    chat_alone = chat(qtbot, win, 12)
    assert chat_alone["batch_width"] == 1 and len(agent_alone) > 0

    # together: the chat joins the agent's batch (same model, one forward for both)
    serving = win.host.worker.serving
    agent = Stream(state, 120)
    with held(serving, lambda: len(serving.batcher.tickets) == 2):
        agent.start()
        assert agent.first.wait(30)
        both = chat(qtbot, win, 12)
    assert agent.result(qtbot) == agent_alone and agent.finish == "length"
    assert both["text"] == chat_alone["text"] and both["token_ids"] == chat_alone["token_ids"]
    assert both["batch_width"] == 2  # it shared forwards with the agent's request
    rows = win.bridge.telemetry.snapshot().requests
    served = [r for r in rows if r["label"].startswith("server")]
    assert [r["width"] for r in served] == [1, 2] and all(r["rounds"] > 0 for r in rows)
    assert served[-1]["tokens"] == 120 and served[-1]["state"] == "length"

    # switched off mid-stream: no new connection, the one in flight is answered to the end
    late = Stream(state, 120)
    kept = http.client.HTTPConnection("127.0.0.1", state["port"], timeout=10)  # a kept-alive connection
    kept.request("GET", "/health")
    first = kept.getresponse()
    assert first.status == 200 and first.read() and kept.sock is not None
    with held(serving, lambda: not serving.on):
        late.start()
        assert late.first.wait(30)
        off = switch(qtbot, win, False)
        assert not off["on"] and refused(state["port"])
        with pytest.raises(openai.APIConnectionError):
            client(state).chat.completions.create(model="tiny", messages=AGENT, max_tokens=2)
        kept.request("POST", "/v1/chat/completions", json.dumps({"messages": AGENT, "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        answer = kept.getresponse()  # its next request is refused too
        assert answer.status == 503 and "switched off" in answer.read().decode()
        kept.close()
    assert late.result(qtbot) == agent_alone and late.finish == "length"
    qtbot.waitUntil(lambda: not win.bridge.serving.get("in_flight"), timeout=WAIT_MS)
    assert chat(qtbot, win, 12)["text"] == chat_alone["text"]  # the chat goes on alone
    # the Telemetry tab lists each request with its rounds and batch width
    win.telemetry.redraw(force=True)
    table = win.telemetry.requests_table
    shown = [[table.topLevelItem(i).text(c) for c in (0, 2, 5, 6)] for i in range(table.topLevelItemCount())]
    rows = win.bridge.telemetry.snapshot().requests[::-1]  # newest first, as shown
    assert shown == [[r["label"], str(r["rounds"]), str(r["width"]), r["state"]] for r in rows]
    chat_row, server_row = "chat | lookup", "server: OpenAI chat"
    assert [(r[0], r[2]) for r in shown] == [(chat_row, "1"), (server_row, "1"), (chat_row, "2"), (server_row, "2"),
                                             (chat_row, "1"), (server_row, "1")]


def test_loading_another_model_while_serving(win, qtbot):
    """Requests in flight end on the model they began on; one that comes during the load waits
    for the new model (``/health`` says loading) and runs on it."""
    SLOW.clear()
    state = switch(qtbot, win, True)
    alone = Stream(state, 80)
    alone.start()
    alone = alone.result(qtbot)
    inflight = Stream(state, 80)
    serving = win.host.worker.serving
    with held(serving, lambda: not serving.runner.ready.is_set()), \
            qtbot.waitSignal(win.bridge.model_loaded, timeout=WAIT_MS) as sig:
        inflight.start()
        assert inflight.first.wait(30)  # it decodes: the load comes in the middle of it
        win.bridge.load("org/slow")
        assert inflight.result(qtbot) == alone  # answered to the end before the old model went
        qtbot.waitUntil(lambda: health(state) == (503, {"status": "loading"}), timeout=WAIT_MS)
        waiting = Stream(state, 6)
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and not waiting.pieces  # it waits for the new model
        SLOW.set()
    assert sig.args[0]["name"] == "org/slow"
    waiting.result(qtbot)
    assert waiting.finish == "length" and len(MADE[-1].encoded) == 1  # rendered for, and run on, the new one
    assert health(state)[1]["model"] == "org/slow"
    assert [m.id for m in client(state).models.list().data] == ["org/slow"]


def test_switch_setting_key_and_web_page_defaults_persist(make_win, qtbot):
    """The port, the API key and the switch itself come back at the next run; both dialects
    answer; the server keeps ``tandem serve``'s defaults: the key on every route but /health,
    web pages refused."""
    win = make_win()
    panel = win.models.serve_panel
    with socket.socket() as taken:  # a port another program holds: the switch says why and goes back off
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        panel.port.setValue(taken.getsockname()[1])
        with qtbot.waitSignal(win.bridge.serving_changed, timeout=WAIT_MS) as sig:
            panel.set_on(True)
    assert "cannot listen" in sig.args[0]["error"] and "cannot listen" in panel.status.text()
    assert not panel.switch.isChecked() and not win.serve_action.isChecked() and panel.port.isEnabled()
    panel.api_key.setText("sesame")
    state = switch(qtbot, win, True)
    assert state["api_key"] and win.serve_action.isChecked() and state["url"] in win.serve_status.text()
    assert get(state, "/v1/models")[0] == 401
    assert get(state, "/v1/models", {"Authorization": "Bearer sesame"})[0] == 200
    assert get(state, "/health")[0] == 200
    assert get(state, "/v1/models", {"Authorization": "Bearer sesame", "Origin": "https://evil.example"})[0] == 403
    assert get(state, "/v1/models", {"Authorization": "Bearer sesame", "Host": "evil.example"})[0] == 403
    win.shutdown()
    assert refused(state["port"])

    again = make_win()  # restarted: serving again once the model is loaded, on the saved settings
    qtbot.waitUntil(lambda: again.bridge.serving.get("on"), timeout=WAIT_MS)
    state = again.bridge.serving
    assert again.models.serve_panel.api_key.text() == "sesame" and again.models.serve_panel.port.value() == 0
    assert again.models.serve_panel.switch.isChecked() and again.serve_action.isChecked()
    reply = openai.OpenAI(base_url=state["url"] + "/v1", api_key="sesame", max_retries=0).chat.completions.create(
        model="tiny", messages=AGENT, max_tokens=3)
    assert reply.usage.completion_tokens == 3
    message = anthropic.Anthropic(base_url=state["url"], api_key="sesame", max_retries=0).messages.create(
        model="tiny", messages=AGENT, max_tokens=3)  # the other dialect on the same port
    assert message.usage.output_tokens == 3 and message.stop_reason == "max_tokens"

    again.serve_action.setChecked(False)  # the menu's switch is the same switch
    qtbot.waitUntil(lambda: not again.bridge.serving.get("on"), timeout=WAIT_MS)
    assert not again.models.serve_panel.switch.isChecked() and refused(state["port"])
    assert again.serve_status.text() == ""


def test_telemetry_keeps_each_requests_rounds_and_follows_the_newest():
    from app.telemetry_model import MAX_REQUESTS, TelemetryBuffer

    tel = TelemetryBuffer()
    tel.begin("server: OpenAI chat", "a")
    tel.set_batch_width(1)
    tel.push_round({"index": 0, "committed": 1, "accepted": 0, "mode": "lookup"}, "a")
    tel.set_batch_width(2)
    tel.begin("chat | lookup", "b")  # joins: the plot follows it, "a" keeps counting in its row
    for key in ("a", "b", "a"):
        tel.push_round({"index": 1, "committed": 3, "accepted": 2, "mode": "lookup"}, key)
    snap = tel.snapshot()
    assert [ev["committed"] for ev in snap.rounds] == [3] and snap.batch_width == 2
    a, b = snap.requests
    assert (a["rounds"], a["tokens"], a["accepted"], a["width"], a["state"]) == (2, 7, 4, 2, "running")
    assert (b["rounds"], b["tokens"], b["width"]) == (1, 3, 2)
    tel.end("b", {"finish_reason": "length", "tokens": 3, "batch_width": 2})
    tel.end("nobody", error="ignored")
    for i in range(MAX_REQUESTS + 5):  # finished rows give way first; the running one stays
        tel.begin(f"chat {i}", i)
        tel.end(i, {"finish_reason": "stop", "tokens": 1, "batch_width": 1})
    rows = tel.snapshot().requests
    assert len(rows) == MAX_REQUESTS and rows[0]["label"] == "server: OpenAI chat"
    assert rows[-1]["label"] == f"chat {MAX_REQUESTS + 4}" and all(r["label"] != "chat | lookup" for r in rows)


def test_server_requests_never_wait_for_a_calibration_a_chat_message_measures_it(win, qtbot):
    """While the app serves, a server request whose --max-draft auto finds this machine
    uncalibrated drafts at the mode's fixed cap and says so, instead of making the chat and every
    other client wait for a measurement; a chat message in that mode measures it, showing how far
    it got, and the server's requests use it from then on."""
    state = switch(qtbot, win, True)
    ask = dict(model="tiny", messages=AGENT, max_tokens=6, temperature=0, extra_body={"tandem": {"mode": "auto"}})

    def answered() -> dict:
        out: dict = {}
        thread = threading.Thread(target=lambda: out.update(r=client(state).chat.completions.create(**ask)), daemon=True)
        thread.start()
        qtbot.waitUntil(lambda: not thread.is_alive(), timeout=WAIT_MS)
        return out["r"].x_tandem

    first = answered()
    assert isinstance(first["cap"], int) and "not calibrated on this machine yet" in first["note"]
    measured: list = []
    win.bridge.gen_calibrating.connect(lambda rid, done, total, what: measured.append((done, total)))
    c = win.chat
    c.new_chat()
    c.mode.setCurrentText("auto")
    c.max_tokens.setValue(4)
    with qtbot.waitSignal(win.bridge.gen_finished, timeout=WAIT_MS) as sig:
        assert c.send(CHAT) is not None
    assert measured and measured[-1][0] == measured[-1][1] and sig.args[1]["cap"] == "auto"
    later = answered()
    assert later["cap"] == "auto" and not later["note"]
    switch(qtbot, win, False)
