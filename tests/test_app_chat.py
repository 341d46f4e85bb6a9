"""The Chat tab end to end under pytest-qt (offscreen): saved conversations, regenerate and edit,
the system prompt, Markdown in the transcript, settings across restarts, the model switch.

The worker runs a tiny random llama whose tokenizer has a chat template (roles are the words
w2/w3/w4), so the whole history goes through ``apply_chat_template`` as with a real model. Each
test gets its own app-data folder (tests/conftest.py sets TANDEM_APP_DATA)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication, QTextTable

from app import theme
from app.conversations import ConversationStore
from app.main import MainWindow
from app.settings import AppSettings, history_path
from app.views.chat_widgets import MessageWidget
from app.bridge import Bridge
from app.views.race import RaceView
from engine.errors import TandemError
from engine.generate import Engine
from tests.test_app_gui import tiny_engine
from tests.test_app_hub import TARGET, build_cache

ROOT = Path(__file__).resolve().parents[1]
WAIT_MS = 30_000
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}w2 {% elif m['role'] == 'user' %}w3 "
            "{% else %}w4 {% endif %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}")


class ChatEngine(Engine):
    """The tiny engine with a chat template; records every prompt it encodes."""

    def __init__(self):
        base = tiny_engine()
        base.tokenizer._tokenizer.chat_template = TEMPLATE
        super().__init__(base.model, base.tokenizer, name="tiny-chat")
        self.encoded: list[list[int]] = []
        self.clears = 0

    def encode(self, prompt, **kw):
        ids = super().encode(prompt, **kw)
        self.encoded.append(ids)
        return ids


class Future(ChatEngine):
    """Speaks the engine contracts being added in parallel: a prefix cache (cached tokens in the
    result, a clear method) and mode support that names a mode the app does not list yet."""

    def stream(self, prompt, **kw):
        for chunk in super().stream(prompt, **kw):
            if chunk.result is not None:
                chunk.result.cached_tokens = 5
            yield chunk

    def mode_support(self):
        return {"auto": None, "baseline": None, "lookup": None, "draft": "needs --draft-model",
                "dspark": "no DSpark drafter for this model", "dflash": "no DFlash drafter",
                "eagle3": "no EAGLE-3 drafter", "mtp": "the model has no MTP head", "medusa": "no Medusa heads"}

    def clear_prefix_cache(self):
        self.clears += 1


def chat_engine(spec=None, drafter=None) -> ChatEngine:
    if spec == "org/broken":
        raise TandemError("org/broken: cannot load model (planted failure)")
    return ChatEngine()


@pytest.fixture
def make_win(qtbot, tmp_path, monkeypatch):
    """Windows over one app-data folder (a second one is the app restarted)."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "tandem"))
    cache = build_cache(tmp_path)
    engines: list[ChatEngine] = []
    made: list[MainWindow] = []

    def factory_for(cls):
        def factory(spec, drafter):
            eng = cls() if spec != "org/broken" else chat_engine(spec)
            engines.append(eng)
            return eng
        return factory

    def make(cls=ChatEngine) -> MainWindow:
        w = MainWindow(engine_factory=factory_for(cls), cache_dir=str(cache))
        w.engines = engines
        qtbot.addWidget(w)
        made.append(w)
        qtbot.waitUntil(lambda: w.chat.model_ready, timeout=WAIT_MS)
        return w

    yield make
    for w in made:
        w.shutdown()


def answer(qtbot, win, action) -> dict:
    """Run ``action`` (send, regenerate, edit) and wait for its answer."""
    with qtbot.waitSignal(win.bridge.gen_finished, timeout=WAIT_MS) as sig:
        assert action() is not None
    qtbot.waitUntil(lambda: not win.chat.generating, timeout=WAIT_MS)
    return sig.args[1]


def greedy(chat, max_tokens=10):
    chat.mode.setCurrentText("baseline")
    chat.temperature.setValue(0.0)
    chat.max_tokens.setValue(max_tokens)


def stored(conversation_id):
    store = ConversationStore(history_path())
    try:
        return store.load(conversation_id)
    finally:
        store.close()


# -- conversations ---------------------------------------------------------------------------------------
def test_conversation_saved_per_turn_and_restored_after_restart(make_win, qtbot):
    win = make_win()
    chat = win.chat
    greedy(chat)
    chat.system_prompt.setPlainText("w20 w21")
    first = answer(qtbot, win, lambda: chat.send("w5 w6 w7"))
    cid = chat.conv.id
    assert cid is not None and chat.conv.title == "w5 w6 w7"  # titled from the first message
    second = answer(qtbot, win, lambda: chat.send("w8 w9"))
    chat.rename_conversation(cid, "Numbers")
    saved = stored(cid)  # on disk already, before any shutdown
    assert [m.content for m in saved.messages] == ["w5 w6 w7", first["text"], "w8 w9", second["text"]]
    assert saved.messages[3].stats["tokens"] == 10 and saved.messages[3].stats["mode"] == "baseline"
    assert saved.system_prompt == "w20 w21" and saved.settings["max_tokens"] == 10
    assert history_path().parent == Path(os.environ["TANDEM_APP_DATA"])
    win.shutdown()

    again = make_win()  # restart: the last chat is open again, with its settings
    c2 = again.chat
    assert c2.conv.id == cid and c2.title.full_text == "Numbers"
    assert [m["content"] for m in c2.messages] == ["w5 w6 w7", first["text"], "w8 w9", second["text"]]
    assert c2.system_prompt.toPlainText() == "w20 w21" and c2.max_tokens.value() == 10
    assert c2.mode.currentText() == "baseline"
    bubbles = [b for b in c2.bubbles if b.role == "assistant"]
    assert bubbles[-1].content == second["text"] and "tok/s" in bubbles[-1].footer.text()
    assert c2.sidebar.ids() == [cid]
    # the conversation goes on from where it was
    third = answer(qtbot, again, lambda: c2.send("w10"))
    assert len(stored(cid).messages) == 6 and stored(cid).messages[-1].content == third["text"]


def test_conversation_sidebar_new_search_rename_delete_export(make_win, qtbot, tmp_path):
    win = make_win()
    chat = win.chat
    greedy(chat, 4)
    answer(qtbot, win, lambda: chat.send("w5 w6"))
    a = chat.conv.id
    clears = win.engines[-1].clears
    chat.new_chat()
    assert chat.conv.id is None and chat.bubbles == [] and not chat.welcome.isHidden()
    assert chat.sidebar.ids() == [a]  # an empty new chat is not saved
    answer(qtbot, win, lambda: chat.send("w30 w31"))
    b = chat.conv.id
    assert chat.sidebar.ids() == [b, a]
    chat.sidebar.search.setText("w30")
    assert chat.sidebar.ids() == [b]
    chat.sidebar.search.setText("zzz")
    assert chat.sidebar.ids() == [] and "no chat matches" in chat.sidebar.empty.text()
    chat.sidebar.search.clear()

    item = chat.sidebar.item_for(a)  # rename in place, as a double-click edit would
    item.setText("First chat")
    assert stored(a).title == "First chat"
    assert chat.open_conversation(a) and chat.messages[0]["content"] == "w5 w6" and chat.title.full_text == "First chat"

    md_path = chat.export_conversation(a, str(tmp_path / "out.md"))
    assert md_path.read_text().startswith("# First chat") and "w5 w6" in md_path.read_text()
    chat.ask_save_path = lambda title, suggested, filt: str(tmp_path / suggested)
    js = chat.export_conversation(fmt="json")
    assert js.name == "First chat.json" and '"title": "First chat"' in js.read_text()

    chat.confirm = lambda title, text: False  # the user says no
    assert not chat.delete_conversation(a) and stored(a) is not None
    chat.confirm = lambda title, text: True
    assert chat.delete_conversation(a)
    assert stored(a) is None and chat.conv.id == b and chat.sidebar.ids() == [b]
    qtbot.waitUntil(lambda: win.engines[-1].clears == clears, timeout=WAIT_MS)  # no clear method: nothing to call


def test_conversation_crash_mid_turn_loses_only_that_turn(tmp_path):
    """A real crash: a child app process dies (os._exit) while its second answer streams; the
    history file then holds the first turn, whole, and nothing of the second."""
    data = tmp_path / "appdata"
    script = textwrap.dedent(f"""
        import os, sys, time
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
        os.environ["TANDEM_APP_DATA"] = {str(data)!r}
        sys.path.insert(0, {str(ROOT)!r})
        import engine
        from PySide6.QtWidgets import QApplication
        from app.main import MainWindow
        from tests.test_app_chat import chat_engine
        app = QApplication([])
        win = MainWindow(engine_factory=chat_engine, cache_dir={str(tmp_path / "hub")!r})
        def pump(cond):
            end = time.monotonic() + 60
            while not cond():
                if time.monotonic() > end:
                    sys.exit(1)
                app.processEvents()
                time.sleep(0.002)
        pump(lambda: win.chat.model_ready)
        win.chat.mode.setCurrentText("baseline")
        win.chat.max_tokens.setValue(6)
        win.chat.send("w5 w6 w7")
        pump(lambda: not win.chat.generating)
        print("FIRST", win.chat.conv.id, repr(win.chat.conv.messages[1].content), flush=True)
        win.bridge.gen_text.connect(lambda rid, text: os._exit(3))
        win.chat.max_tokens.setValue(400)
        win.chat.send("w8 w9")
        pump(lambda: False)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 3, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FIRST"))
    _, cid, first_answer = line.split(" ", 2)
    store = ConversationStore(data / "conversations.sqlite3")
    conv = store.load(int(cid))
    assert [(m.role, m.content) for m in conv.messages] == [("user", "w5 w6 w7"),
                                                            ("assistant", ast.literal_eval(first_answer))]


def test_conversation_quit_mid_answer_keeps_what_was_written(make_win, qtbot):
    """Quitting stops the answer within a round; the part already written is saved, marked stopped."""
    win = make_win()
    chat = win.chat
    greedy(chat, 4000)
    chunks = []
    with qtbot.waitSignal(win.bridge.gen_text, timeout=WAIT_MS):
        chat.send("w5 w6")
    win.bridge.gen_text.connect(lambda rid, text: chunks.append(text))
    qtbot.waitUntil(lambda: len(chunks) >= 3, timeout=WAIT_MS)
    cid_before = chat.conv.id
    win.shutdown()
    assert cid_before is None and chat.conv.id is not None  # the chat was created by that save
    saved = stored(chat.conv.id)
    assert saved.messages[0].content == "w5 w6" and saved.messages[1].stats["finish_reason"] == "cancelled"
    assert 0 < saved.messages[1].stats["tokens"] < 4000 and saved.messages[1].content.strip()


def test_conversation_turn_in_flight_is_not_on_disk_until_it_ends(make_win, qtbot):
    """Also for an edit: the turns it replaces stay on disk until the new answer is complete."""
    win = make_win()
    chat = win.chat
    greedy(chat, 6)
    for q in ("w5 w6", "w7 w8"):
        answer(qtbot, win, lambda q=q: chat.send(q))
    before = [m.content for m in stored(chat.conv.id).messages]
    seen = []
    win.bridge.gen_text.connect(lambda rid, text: seen.append([m.content for m in stored(chat.conv.id).messages]))
    answer(qtbot, win, lambda: chat.edit_message(0, "w40"))
    assert seen and all(s == before for s in seen)
    after = stored(chat.conv.id).messages
    assert [m.content for m in after][:1] == ["w40"] and len(after) == 2


def test_history_file_unreadable_is_reported_and_left_alone(make_win, qtbot):
    junk = b"not a database, and not ours to overwrite " * 50
    history_path().parent.mkdir(parents=True, exist_ok=True)
    history_path().write_bytes(junk)
    win = make_win()
    chat = win.chat
    assert "unreadable" in chat.status.text() and "kept only until you quit" in chat.status.text()
    greedy(chat, 4)
    answer(qtbot, win, lambda: chat.send("w5 w6"))  # the chat works, in memory
    assert chat.sidebar.ids() == [chat.conv.id] and len(chat.messages) == 2
    win.shutdown()
    assert history_path().read_bytes() == junk


# -- regenerate, edit, stop ------------------------------------------------------------------------------
def test_regenerate_gives_what_a_fresh_run_of_the_same_history_gives(make_win, qtbot):
    win = make_win()
    chat = win.chat
    greedy(chat, 12)
    answer(qtbot, win, lambda: chat.send("w5 w6 w7"))
    old = answer(qtbot, win, lambda: chat.send("w8 w9 w10"))
    history = chat.conv.chat_messages(3)  # without the last answer
    new = answer(qtbot, win, chat.regenerate)
    assert len(chat.conv.messages) == 4 and chat.conv.messages[3].content == new["text"]
    fresh = chat_engine().generate(history, mode="baseline", max_new_tokens=12)
    assert new["token_ids"] == fresh.token_ids and new["text"] == fresh.text == old["text"]
    eng = win.engines[-1]
    assert eng.encoded[-1] == eng.tokenizer.apply_chat_template(history, add_generation_prompt=True)
    assert [m.content for m in stored(chat.conv.id).messages][3] == new["text"]
    # the Regenerate button sits on the last answer only
    assert [b.regen_button.isVisibleTo(chat) for b in chat.bubbles] == [False, False, False, True]


def test_regenerate_with_sampling_and_seed_is_a_fresh_sample(make_win, qtbot):
    win = make_win()
    chat = win.chat
    chat.mode.setCurrentText("lookup")
    chat.temperature.setValue(1.0)
    chat.seed.setValue(7)
    chat.max_tokens.setValue(10)
    first = answer(qtbot, win, lambda: chat.send("w5 w6 w7"))
    again = answer(qtbot, win, chat.regenerate)
    fresh = chat_engine().generate(chat.conv.chat_messages(1), mode="lookup", max_new_tokens=10,
                                   temperature=1.0, seed=7)
    assert first["token_ids"] == again["token_ids"] == fresh.token_ids  # same seed: the same exact sample


def test_regenerate_edit_drops_later_turns_and_matches_a_fresh_run(make_win, qtbot):
    win = make_win()
    chat = win.chat
    greedy(chat, 8)
    for q in ("w5 w6", "w7 w8", "w9 w10"):
        answer(qtbot, win, lambda q=q: chat.send(q))
    assert len(chat.conv.messages) == 6
    edited = answer(qtbot, win, lambda: chat.edit_message(2, "w40 w41"))
    assert [m.content for m in chat.conv.messages][:3] == ["w5 w6", chat.conv.messages[1].content, "w40 w41"]
    assert len(chat.conv.messages) == 4 and len(chat.bubbles) == 4
    fresh = chat_engine().generate(chat.conv.chat_messages(3), mode="baseline", max_new_tokens=8)
    assert edited["token_ids"] == fresh.token_ids and chat.conv.messages[3].content == fresh.text
    assert [m.content for m in stored(chat.conv.id).messages] == [m.content for m in chat.conv.messages]
    # through the bubble's own editor
    user = chat.bubbles[0]
    user.start_edit()
    assert not user.editor.isHidden() and user.editor.toPlainText() == "w5 w6"
    user.editor.setPlainText("w50")
    with qtbot.waitSignal(win.bridge.gen_finished, timeout=WAIT_MS):
        user.save_edit.click()
    qtbot.waitUntil(lambda: not chat.generating, timeout=WAIT_MS)
    assert [m.content for m in chat.conv.messages][0] == "w50" and len(chat.conv.messages) == 2
    assert chat.edit_message(1, "not a user message") is None


def test_regenerate_stopped_before_text_keeps_the_chat_and_the_question(make_win, qtbot):
    win = make_win()
    chat = win.chat
    greedy(chat, 4)
    answer(qtbot, win, lambda: chat.send("w5 w6"))
    before = [m.content for m in chat.conv.messages]
    chat.bridge.cancel(chat.bridge._issued + 1)  # the next request is cancelled while queued, as after a Stop
    with qtbot.waitSignal(win.bridge.gen_failed, timeout=WAIT_MS):
        chat.send("w9 w9 w9")
    qtbot.waitUntil(lambda: not chat.generating, timeout=WAIT_MS)
    assert [m.content for m in chat.conv.messages] == before and len(chat.bubbles) == 2
    assert chat.input.toPlainText() == "w9 w9 w9"  # nothing the user typed is lost
    assert [m.content for m in stored(chat.conv.id).messages] == before


# -- system prompt ---------------------------------------------------------------------------------------
def test_system_prompt_reaches_the_chat_template(make_win, qtbot):
    win = make_win()
    chat = win.chat
    greedy(chat, 4)
    chat.system_prompt.setPlainText("w20 w21")  # typed: saved after a pause, or at send
    result = answer(qtbot, win, lambda: chat.send("w5 w6"))
    eng = win.engines[-1]
    assert eng.encoded[-1] == [2, 20, 21, 3, 5, 6, 4]  # system, user, then the assistant's turn opens
    assert result["prompt_tokens"] == 7
    answer(qtbot, win, lambda: chat.send("w7"))
    first = chat.conv.messages[1].content
    assert eng.encoded[-1] == eng.tokenizer.encode(f"w2 w20 w21 w3 w5 w6 w4 {first} w3 w7 w4",
                                                   add_special_tokens=False)
    chat.system_prompt.setPlainText("")
    chat.panel.flush()
    answer(qtbot, win, lambda: chat.send("w8"))
    assert eng.encoded[-1][:3] == [3, 5, 6]  # no system turn at all once it is empty
    assert stored(chat.conv.id).system_prompt == ""


# -- markdown in the transcript ----------------------------------------------------------------------------
MARKDOWN = ("<think>private steps</think>Here:\n\n```python\ndef double(x):\n    return 2 * x\n```\n\n"
            "| n | 2n |\n|---|---|\n| 1 | 2 |\n")


def test_markdown_renders_code_tables_and_folded_reasoning(qtbot):
    bubble = MessageWidget("assistant", MARKDOWN)
    qtbot.addWidget(bubble)
    bubble.resize(600, 400)
    doc = bubble.body.document()
    text = doc.toPlainText()
    assert "def double(x):" in text and "```" not in text and "private steps" not in text
    assert "Reasoning · 2 words" in text and "Copy" in text
    tables = [f for f in doc.rootFrame().childFrames() if isinstance(f, QTextTable)]
    assert len(tables) == 2 and tables[1].rows() == 2 and tables[1].columns() == 2  # code block, table
    assert tables[1].cellAt(0, 1).firstCursorPosition().block().text() == "2n"
    # the code is coloured by Pygments: "def" and "double" carry different colours
    block = doc.findBlock(text.index("def double"))
    assert len({f.format.foreground().color().name() for f in block.textFormats()}) >= 2
    bubble.body.anchorClicked.emit(QUrl("copy:0"))  # the block's Copy link
    assert QGuiApplication.clipboard().text() == "def double(x):\n    return 2 * x"
    assert bubble.copy() == QGuiApplication.clipboard().text() and "private steps" not in bubble.copy()
    bubble.body.toggle_thought(0)
    assert "private steps" in bubble.body.toPlainText()
    assert bubble.body.height() >= doc.size().height()  # as tall as its text: no inner scrolling


def test_markdown_streaming_renders_the_last_message_only_and_keeps_the_scroll(make_win, qtbot):
    win = make_win()
    chat = win.chat
    win.resize(900, 500)
    win.show()
    greedy(chat, 12)
    for q in ("w5 w6", "w7 w8", "w9", "w10", "w11"):
        answer(qtbot, win, lambda q=q: chat.send(q))
    earlier = [(b, b.body.rendered) for b in chat.bubbles]  # each render makes a new Rendered
    bar = chat.scroll.verticalScrollBar()
    chat.max_tokens.setValue(60)
    seen = []

    def on_text(rid, text):
        if not seen:
            bar.setValue(0)  # the user scrolls up to read while the answer streams
        seen.append(bar.value())

    win.bridge.gen_text.connect(on_text)
    answer(qtbot, win, lambda: chat.send("w12"))
    # 60 tokens stream in >= 2 pieces (drafts are capped at 32); how many more depends on live timings
    assert len(seen) >= 2 and bar.maximum() > 0 and set(seen) == {0} and bar.value() == 0  # not pulled down
    assert all(b.body.rendered is r for b, r in earlier)  # the earlier messages were left alone
    last = chat.bubbles[-1]
    assert last.content == chat.conv.messages[-1].content
    win.bridge.gen_text.disconnect(on_text)
    # at the bottom, the view follows the answer as it grows
    tops = []
    win.bridge.gen_text.connect(lambda rid, text: tops.append(bar.maximum()))
    answer(qtbot, win, lambda: chat.send("w13"))
    qtbot.waitUntil(lambda: bar.value() == bar.maximum(), timeout=WAIT_MS)
    assert bar.maximum() > tops[0]


def test_markdown_race_lanes_render_code(qtbot):
    race = RaceView(Bridge())
    qtbot.addWidget(race)
    race._make_lanes(["baseline", "lookup"])
    lane = race.lanes[1]
    pieces = ["Code:", "\n\n```", "python\n", "x = 1\n", "```\n"]
    for piece in pieces:  # while the lane runs: its text as Markdown
        lane.append_live(piece)
    assert lane.body.toPlainText() == ""  # not rendered per piece (GUI-thread work during decoding) ...
    qtbot.waitUntil(lambda: "x = 1" in lane.body.toPlainText(), timeout=2000)  # ... but within 60 ms
    assert "x = 1" in lane.body.toPlainText() and "```" not in lane.body.toPlainText()
    lane.data = {"pieces": pieces, "token_ids": list(range(len(pieces))), "mode": "lookup",
                 "sources": ["target"] * len(pieces)}
    lane.render_upto(len(pieces))  # the replay: the raw tokens, each coloured by source and diff
    assert "```" in lane.body.toPlainText() and not race.legend.isHidden()
    race.markdown_box.setChecked(True)
    assert "```" not in lane.body.toPlainText() and "x = 1" in lane.body.toPlainText() and race.legend.isHidden()
    race.markdown_box.setChecked(False)
    theme.apply(QGuiApplication.instance(), "dark")  # a theme change re-renders Markdown, not the token view
    assert "```" in lane.body.toPlainText()
    theme.apply(QGuiApplication.instance(), "light")


# -- settings ----------------------------------------------------------------------------------------------
def test_settings_persist_across_restart(make_win, qtbot):
    win = make_win()
    assert theme.current() == "light"  # offscreen has no colour scheme: "system" is light
    win.set_theme("dark")
    win.set_font_size(13)
    chat = win.chat
    chat.mode.setCurrentText("lookup")
    chat.temperature.setValue(0.7)
    chat.top_k.setValue(40)
    chat.seed.setValue(3)
    chat.save_defaults()
    chat.show_parameters(True)
    win.resize(1111, 777)
    geometry = win.saveGeometry()
    win.shutdown()
    assert AppSettings().theme == "dark" and AppSettings().window_geometry == geometry
    assert (Path(os.environ["TANDEM_APP_DATA"]) / "settings.ini").exists()

    again = make_win()
    assert theme.current() == "dark" and again.theme_actions["dark"].isChecked()
    assert QGuiApplication.instance().font().pointSizeF() == 13
    c = again.chat
    assert not c.panel.isHidden() and c.params_button.isChecked()
    c.new_chat()
    assert (c.mode.currentText(), c.temperature.value(), c.top_k.value(), c.seed.value()) == ("lookup", 0.7, 40, 3)
    p = c.params()
    assert p["mode"] == "lookup" and p["temperature"] == 0.7 and p["top_k"] == 40 and p["seed"] == 3
    c.reset_to_defaults()
    assert c.temperature.value() == 0.7
    again.set_theme("system")
    again.set_font_size(0)
    assert theme.current() == "light"
    assert "#15171c" not in QGuiApplication.instance().styleSheet()  # the dark window colour is gone


def test_settings_menus_show_the_shortcuts(make_win):
    win = make_win()
    shortcuts = {a.text(): a.shortcut().toString() for m in win.menuBar().actions() for a in m.menu().actions()}
    assert shortcuts["New chat"] == "Ctrl+N" and shortcuts["Send"] == "Ctrl+Return"
    assert shortcuts["Stop"] == "Ctrl+." and shortcuts["Regenerate last answer"] == "Ctrl+R"
    assert shortcuts["Focus the prompt"] == "Ctrl+L"
    menus = [a.text() for a in win.menuBar().actions()]
    assert menus == ["&File", "&Chat", "&View"]
    win.tabs.setCurrentWidget(win.race)
    win.new_chat_action.trigger()
    assert win.tabs.currentWidget() is win.chat


# -- model switch and the engine's new contracts --------------------------------------------------------
def test_conversation_model_switch_keeps_the_chat(make_win, qtbot):
    win = make_win()
    chat = win.chat
    model = chat.mode.model()  # Engine.mode_support(): modes this model cannot run are greyed, with the reason
    draft = model.item(chat.mode.findText("draft"))
    assert model.item(chat.mode.findText("lookup")).isEnabled() and not draft.isEnabled()
    assert "--draft-model" in draft.toolTip()
    greedy(chat, 4)
    answer(qtbot, win, lambda: chat.send("w5 w6"))
    box = chat.header.model_box

    def names():
        return [box.itemData(i) for i in range(box.count())]

    qtbot.waitUntil(lambda: TARGET in names(), timeout=WAIT_MS)  # the Models tab's scan, on its thread
    assert "org/tiny-dspark" not in names()  # targets only
    loading = []
    win.bridge.model_loading.connect(lambda what: loading.append(not chat.header.load_bar.isHidden()))
    with qtbot.waitSignal(win.bridge.model_loaded, timeout=WAIT_MS) as sig:
        box.activated.emit(names().index(TARGET))
    assert loading == [True] and sig.args[0]["spec"] == TARGET
    assert chat.header.model_box.currentData() == TARGET and chat.header.load_bar.isHidden()
    assert chat.messages[0]["content"] == "w5 w6" and len(chat.messages) == 2  # the chat stays
    answer(qtbot, win, lambda: chat.send("w7"))
    assert len(win.engines) == 2 and win.engines[-1].encoded  # the new model answered

    with qtbot.waitSignal(win.bridge.model_failed, timeout=WAIT_MS):
        chat.header.switch_model("org/broken")
    assert "planted failure" in chat.banner_text.text() and not chat.banner.isHidden()
    assert chat.header.model_box.currentData() == TARGET and chat.header.model_box.isEnabled()
    assert answer(qtbot, win, lambda: chat.send("w8"))["tokens"] == 4


def test_conversation_uses_mode_support_cached_tokens_and_clears_the_cache(make_win, qtbot):
    win = make_win(Future)
    chat = win.chat
    model = chat.mode.model()
    enabled = {chat.mode.itemText(i): model.item(i).isEnabled() for i in range(chat.mode.count())}
    assert enabled == {"auto": True, "baseline": True, "lookup": True, "draft": False, "dspark": False,
                       "dflash": False, "eagle3": False, "mtp": False, "medusa": False}
    assert "no DSpark drafter" in model.item(chat.mode.findText("dspark")).toolTip()
    greedy(chat, 4)
    answer(qtbot, win, lambda: chat.send("w5 w6"))
    assert "(5 cached)" in chat.bubbles[-1].footer.text()
    assert stored(chat.conv.id).messages[1].stats["cached_tokens"] == 5
    eng = win.engines[-1]
    chat.new_chat()
    qtbot.waitUntil(lambda: eng.clears == 1, timeout=WAIT_MS)
    with qtbot.waitSignal(win.bridge.model_loaded, timeout=WAIT_MS):
        chat.header.switch_model(TARGET)
    assert eng.clears == 2  # the replaced model's cache is dropped with it
    assert threading.current_thread() is threading.main_thread()


# -- the thinking switch -----------------------------------------------------------------------------------
THINK_TEMPLATE = TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %} w30 w31{% endif %}"


class ThinkingEngine(ChatEngine):
    """A template with Qwen3's switch: thinking off appends an (empty) think block, here w30 w31."""

    def __init__(self):
        super().__init__()
        self.tokenizer._tokenizer.chat_template = THINK_TEMPLATE


def test_think_toggle_is_offered_where_the_template_has_the_switch_and_saved_per_chat(make_win, qtbot):
    win = make_win()
    assert win.chat.think.isHidden()  # no enable_thinking in this template
    win.shutdown()
    win = make_win(ThinkingEngine)
    chat, eng = win.chat, win.engines[-1]
    assert not chat.think.isHidden() and chat.think.isChecked()
    greedy(chat, 3)
    answer(qtbot, win, lambda: chat.send("w5 w6"))
    assert eng.encoded[-1][-2:] != [30, 31]
    chat.think.setChecked(False)
    answer(qtbot, win, lambda: chat.send("w7"))
    assert eng.encoded[-1][-2:] == [30, 31]  # the template was told enable_thinking=false
    cid = chat.conv.id
    assert stored(cid).settings["thinking"] is False
    chat.new_chat()
    assert chat.think.isChecked()  # a new chat starts from the defaults
    chat.open_conversation(cid)
    assert not chat.think.isChecked()


def test_a_first_auto_message_shows_its_calibration_and_stop_cancels_it(make_win, qtbot):
    """On a machine with no calibration of the model, the first ``--max-draft auto`` message
    measures the machine before its first token: its message says how far that got, Stop ends it
    between two measurements and leaves the chat as it was, and the next message measures and
    answers."""
    win = make_win()
    chat = win.chat
    chat.mode.setCurrentText("auto")
    chat.max_tokens.setValue(4)
    footers: list[str] = []

    def stop_at_first(rid: int, done: int, total: int, what: str) -> None:
        footers.append(chat.turn.bubble.footer.text())
        if len(footers) == 1:
            chat._send_or_stop()  # the user's Stop, while it measures

    win.bridge.gen_calibrating.connect(stop_at_first)
    with qtbot.waitSignal(win.bridge.gen_failed, timeout=WAIT_MS) as failed:
        chat.send("w5 w6 w7")
    qtbot.waitUntil(lambda: not chat.generating, timeout=WAIT_MS)
    assert failed.args[1] == "cancelled" and "measuring this machine" in footers[0]
    assert chat.conv.messages == [] and chat.input.toPlainText() == "w5 w6 w7"
    win.bridge.gen_calibrating.disconnect(stop_at_first)

    measured = []
    win.bridge.gen_calibrating.connect(lambda rid, done, total, what: measured.append((done, total)))
    assert win.bridge.telemetry.calibration is None  # nothing measured on this machine yet
    result = answer(qtbot, win, lambda: chat.send("w5 w6 w7"))
    assert measured and measured[-1][0] == measured[-1][1] and result["cap"] == "auto"
    assert win.bridge.telemetry.calibration["verify_ms"]  # the Telemetry tab plots what was measured
    measured.clear()
    answer(qtbot, win, lambda: chat.send("w8 w9"))  # measured once: the next message starts at once
    assert not measured
