"""The desktop app end to end under pytest-qt (offscreen): the real worker thread running a tiny
random engine (built in that thread by an injected factory), the real views and signals."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from app.bridge import Bridge
from app.main import MainWindow
from app.views.chat_widgets import MessageWidget
from app.worker import EngineWorker
from engine.errors import TandemError
from engine.generate import Engine
from tests.test_app_hub import DRAFTER, TARGET, FakeHub, build_cache
from tests.tiny import make_tiny_model, make_tokenizer

PROMPT = "w5 w6 w7 w8 w9 w10 w5 w6 w7 w8 w9 w10 w5 w6 w7"
WAIT_MS = 30_000


def tiny_engine() -> Engine:
    """A tiny random llama that never emits EOS (its EOS logit is pinned to 0, below the best
    of 95 random logits), so a generation runs until its limit or a cancel."""
    model = make_tiny_model("llama", seed=0)
    w = model.lm_head.weight
    w[0] = 0.0
    model.lm_head.weight = w
    mx.eval(model.parameters())
    return Engine(model, make_tokenizer(), name="tiny-llama")


def tiny_factory(spec, drafter):
    if spec == "org/broken":
        raise TandemError("org/broken: cannot load model (planted failure)")
    assert threading.current_thread() is not threading.main_thread()  # loads happen in the worker thread
    return tiny_engine()


@pytest.fixture
def win(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "tandem"))  # calibrations land here, not in ~/.cache
    w = MainWindow(engine_factory=tiny_factory, cache_dir=str(build_cache(tmp_path)))
    qtbot.addWidget(w)
    qtbot.waitUntil(lambda: w.chat.model_ready, timeout=WAIT_MS)
    yield w
    w.shutdown()  # joins the worker thread before the widgets die
    assert not w.host.thread.isRunning()


def ask(qtbot, win, text, mode="baseline", max_tokens=24) -> dict:
    chat = win.chat
    chat.mode.setCurrentText(mode)
    chat.max_tokens.setValue(max_tokens)
    with qtbot.waitSignal(win.bridge.gen_finished, timeout=WAIT_MS) as sig:
        assert chat.send(text) is not None
    qtbot.waitUntil(lambda: not chat.generating, timeout=WAIT_MS)
    return sig.args[1]


# -- chat ----------------------------------------------------------------------------------------------
def test_chat_streams_tokens_from_the_worker(win, qtbot):
    chunks = []
    win.bridge.gen_text.connect(lambda rid, text: chunks.append(text))
    result = ask(qtbot, win, PROMPT, "baseline", 24)
    assert result["tokens"] == 24 and result["finish_reason"] == "length"
    assert len(chunks) >= 10  # streamed round by round, not in one piece
    assert "".join(chunks) == result["text"]
    bubbles = [b for b in win.chat.findChildren(MessageWidget) if b.role == "assistant"]
    assert bubbles[-1].content == result["text"] and "tok/s" in bubbles[-1].footer.text()
    assert [m["role"] for m in win.chat.messages] == ["user", "assistant"]
    assert not win.chat.generating and win.chat.send_button.text() == "Send"
    # second turn, another mode: the conversation grows and greedy output is the same text as baseline
    again = ask(qtbot, win, PROMPT, "lookup", 24)
    assert [m["role"] for m in win.chat.messages] == ["user", "assistant"] * 2
    assert again["mode"] == "lookup" and again["tokens"] == 24


def test_chat_cancel_stops_within_one_round(win, qtbot):
    chat, tel = win.chat, win.bridge.telemetry
    chat.mode.setCurrentText("lookup")
    chat.max_tokens.setValue(4000)
    at_cancel = {}

    def on_text(rid, text):
        if not at_cancel and rid == chat.request_id:
            chat.stop()  # sets the flag the worker reads after every round
            rounds = tel.snapshot().rounds
            at_cancel["round"] = rounds[-1]["index"] if rounds else 0

    win.bridge.gen_text.connect(on_text)
    with qtbot.waitSignal(win.bridge.gen_finished, timeout=WAIT_MS) as sig:
        chat.send(PROMPT)
    result = sig.args[1]
    assert result["finish_reason"] == "cancelled" and result["tokens"] < 4000
    assert len(result["rounds"]) - 1 <= at_cancel["round"] + 1  # at most the round in flight finished
    qtbot.waitUntil(lambda: not chat.generating, timeout=WAIT_MS)
    assert "stopped" in chat.status.text()
    assert ask(qtbot, win, "w11 w12", "baseline", 5)["tokens"] == 5  # and the app carries on


def test_failed_load_shows_the_error_and_keeps_the_model(win, qtbot):
    with qtbot.waitSignal(win.bridge.model_failed, timeout=WAIT_MS) as sig:
        win.bridge.load("org/broken")
    assert "planted failure" in sig.args[0]
    assert "planted failure" in win.chat.banner_text.text() and not win.chat.banner.isHidden()
    assert "still using tiny-llama" in win.model_status.text()
    assert "planted failure" in win.models.detail.text()
    assert ask(qtbot, win, "w5 w6", "baseline", 4)["tokens"] == 4


def test_generation_error_is_reported_not_fatal(win, qtbot):
    with qtbot.waitSignal(win.bridge.gen_failed, timeout=WAIT_MS) as sig:
        win.chat.mode.setCurrentText("draft")  # needs a draft model: a one-line TandemError
        win.chat.send(PROMPT)
    assert "--draft-model" in sig.args[1]
    qtbot.waitUntil(lambda: not win.chat.generating, timeout=WAIT_MS)
    assert win.chat.messages == []  # the failed turn is dropped
    assert ask(qtbot, win, "w5 w6", "baseline", 3)["tokens"] == 3


# -- race ----------------------------------------------------------------------------------------------
def test_race_runs_lanes_and_replays(win, qtbot):
    race = win.race
    race.max_tokens.setValue(32)
    with qtbot.waitSignal(win.bridge.race_finished, timeout=WAIT_MS) as sig:
        race.run(PROMPT, modes=["baseline", "lookup", "draft"])
    result = sig.args[1]
    base, lookup, draft = result["lanes"]
    assert base["mode"] == "baseline" and lookup["mode"] == "lookup"
    assert lookup["token_ids"] == base["token_ids"] and len(base["token_ids"]) == 32
    assert all(a <= b for a, b in zip(base["token_times"], base["token_times"][1:]))
    assert "".join(base["pieces"]) == base["text"]
    assert "--draft-model" in draft["error"]  # a failed lane does not end the race
    assert result["verdicts"][1]["status"] == "identical" and result["verdicts"][2] is None
    assert "identical" in race.summary.text() and "failed" in race.summary.text()
    qtbot.waitUntil(lambda: not race.replay_timer.isActive(), timeout=WAIT_MS)
    assert race.timeline.value() == 1000
    assert race.lanes[1].body.toPlainText().strip() == lookup["text"].strip()
    # every token says how it was made: baseline's are all the target's own; lookup's accepted
    # drafts are exactly the lane's accepted tokens, painted in lookup's colour
    from app.views.token_colours import SOURCE_COLOURS

    assert base["sources"] == ["target"] * 32 and len(lookup["sources"]) == 32
    assert lookup["sources"].count("lookup") == sum(a for _, a in lookup["rounds"]) > 0
    assert set(lookup["sources"]) == {"lookup", "target"}
    painted = [_background(f) for f in _token_formats(race.lanes[1])]
    assert painted == [SOURCE_COLOURS["lookup"] if s == "lookup" else None for s in lookup["sources"]]
    assert not race.legend.isHidden()
    assert "tok/s" in race.lanes[1].speed.text() and "×" in race.lanes[1].speed.text()
    assert race.lanes[2].speed.text() == "failed"


def _formats(body) -> list:
    """The char format of every character in a lane's body."""
    from PySide6.QtGui import QTextCursor

    doc = body.document()
    out = []
    for pos in range(doc.characterCount() - 1):
        cur = QTextCursor(doc)
        cur.setPosition(pos + 1)  # charFormat() is the format of the character before the cursor
        out.append(cur.charFormat())
    return out


def _background(fmt):
    from PySide6.QtGui import QTextFormat

    return fmt.background().color().name() if fmt.hasProperty(QTextFormat.Property.BackgroundBrush) else None


def _token_formats(lane) -> list:
    fmts, starts, pos = _formats(lane.body), [], 0
    for piece in lane.data["pieces"][: lane.shown]:
        starts.append(pos)
        pos += len(piece)
    return [fmts[p] for p in starts]


def test_race_lane_colours_tokens_by_source_over_the_diff(qtbot):
    from PySide6.QtGui import QTextCharFormat

    from app.views.common import BAD
    from app.views.race import Lane
    from app.views.token_colours import SOURCE_COLOURS, source_summary

    lane = Lane(1, "dspark")
    qtbot.addWidget(lane)
    sources = ["target", "lookup", "lookup", "drafter", "target", "drafter"]
    data = {"mode": "dspark", "token_ids": [1, 2, 3, 4, 5, 6], "pieces": ["a", " b", " c", " d", " e", "\n f"],
            "sources": sources, "token_times": [0.1 * i for i in range(1, 7)], "decode_tps": 10.0, "tokens": 6,
            "mean_accepted": 1.5, "cap": 4, "ttft_s": 0.1}
    lane.finish(data, 5.0)
    assert "67% drafted (lookup 33%, drafter 33%)" in lane.meta.text()
    assert source_summary(["lookup", "target", "target", "target"]) == "25% drafted by lookup"
    assert source_summary(["target"] * 3) == ""
    lane.set_verdict({"status": "diverged", "ok": False, "text": "first divergence at token 4"}, [1, 2, 3, 4, 9, 9])
    lane.render_upto(3)  # mid-replay: three tokens and a caret
    assert lane.body.toPlainText() == "a b c▍"
    lane.render_upto(6)
    assert lane.body.toPlainText() == "a b c d e\n f" and not lane.caret
    bg = [_background(f) for f in _token_formats(lane)]
    assert bg[:4] == [None, SOURCE_COLOURS["lookup"], SOURCE_COLOURS["lookup"], SOURCE_COLOURS["drafter"]]
    assert bg[4] == BAD  # the first token that differs from baseline
    fmts = _token_formats(lane)
    assert fmts[4].foreground().color().name() == "#ffffff"
    assert bg[5] == SOURCE_COLOURS["drafter"]  # past the divergence: still coloured by source ...
    assert fmts[5].underlineStyle() == QTextCharFormat.UnderlineStyle.WaveUnderline  # ... and marked
    assert fmts[0].underlineStyle() == QTextCharFormat.UnderlineStyle.NoUnderline
    lane.render_upto(2)  # a replay restarts: repainted from scratch
    assert lane.body.toPlainText() == "a b▍" and len(_token_formats(lane)) == 2


def test_race_margin_separates_ties_from_bugs():
    """Plant divergences after a real baseline run; the worker's clean re-run must measure the
    target's logits there: an exact tie (a duplicated lm_head row) vs a clearly worse token."""
    eng = tiny_engine()
    worker = EngineWorker(Bridge(), None)
    worker.engine = eng
    base = eng.generate(PROMPT, mode="baseline", max_new_tokens=12, chat_template=False).token_ids
    i = 6
    expected = base[i]
    prompt_ids = eng.encode(PROMPT, chat_template=False)
    logits = eng.model(mx.array([prompt_ids + base[:i]]))[0, -1]
    worst = int(mx.argmin(logits).item())
    twin = max(t for t in range(eng.target.vocab_size) if t not in base)  # a higher id: ties keep baseline's token
    w = eng.model.lm_head.weight
    w[twin] = w[expected]
    eng.model.lm_head.weight = w
    mx.eval(eng.model.parameters())
    assert eng.generate(PROMPT, mode="baseline", max_new_tokens=12, chat_template=False).token_ids == base

    lane = lambda ids, finish="length": {"mode": "lookup", "token_ids": ids, "finish_reason": finish}  # noqa: E731
    tie_ids = base[:i] + [twin] + base[i + 1:]
    bug_ids = base[:i] + [worst] + base[i + 1:]
    verdicts = worker._verdicts(PROMPT, [lane(base), lane(base), lane(tie_ids), lane(bug_ids), lane(base[:9], "stop"),
                                         lane(base[:4], "cancelled")], {"temperature": 0.0})
    assert verdicts[0] is None and verdicts[1]["status"] == "identical"
    tie, bug, short, stopped = verdicts[2], verdicts[3], verdicts[4], verdicts[5]
    assert tie["status"] == "diverged" and tie["index"] == i and tie["gap"] == 0.0 and tie["ok"]
    assert "floating-point tie" in tie["text"]
    expect_gap = float((logits[expected] - logits[worst]).item())
    assert bug["gap"] == pytest.approx(expect_gap, rel=1e-4) and not bug["ok"] and "bug" in bug["text"]
    # the top-2 margin is 0 here (the twin ties the top token): only the gap tells the bug apart
    assert bug["margin"] == 0.0 and tie["margin"] == 0.0
    # a lane that ended (EOS) where baseline went on diverged there: its gap is measured like any other
    # (the tiny target's EOS logit is pinned to 0, far below baseline's token: a bug, not a tie)
    eos_logits = eng.model(mx.array([prompt_ids + base[:9]]))[0, -1]
    assert short["status"] == "diverged" and (short["index"], short["expected"], short["got"]) == (9, base[9], None)
    assert short["gap"] == pytest.approx(float((eos_logits[base[9]] - eos_logits[0]).item()), rel=1e-4)
    assert not short["ok"] and "end of output (EOS)" in short["text"] and "bug" in short["text"]
    assert stopped["status"] == "cancelled" and stopped["ok"]  # the user stopped it: not a divergence


# -- telemetry -------------------------------------------------------------------------------------------
def test_telemetry_buffers_fill_and_plots_redraw(win, qtbot):
    view = win.telemetry
    assert view.timer.isActive() and view.timer.interval() == 100
    result = ask(qtbot, win, PROMPT, "lookup", 40)
    snap = win.bridge.telemetry.snapshot()
    assert len(snap.rounds) == len(result["rounds"]) and snap.points[-1]["mode"] == "lookup"
    qtbot.waitUntil(lambda: view.drawn_version == win.bridge.telemetry.snapshot().version, timeout=WAIT_MS)
    spec_rounds = len(result["rounds"]) - 1
    assert len(view.accepted_bars.opts["x"]) == spec_rounds
    assert list(view.accepted_bars.opts["height"]) == [a for _, a in result["rounds"][1:]]
    assert len(view.spec_points.data) == 1
    assert view.stat_tau.value.text() == f"{result['mean_accepted']:.2f}"
    xs, ys = view.ceiling_line.getData()
    assert len(xs) > 2 and ys[0] > 0  # bandwidth was measured at load
    redraws = view.redraws
    assert not view.redraw()  # nothing new: no redraw
    win.bridge.telemetry.push_round({"index": 99, "t": 9.0, "drafted": 3, "accepted": 2, "committed": 3,
                                     "context": 80, "generated": 60})
    qtbot.waitUntil(lambda: view.redraws > redraws, timeout=2000)  # the 10 Hz timer picks it up


def test_calibrate_action_reports_progress_and_draws_costs(win, qtbot, tmp_path):
    view = win.telemetry
    steps = []
    win.bridge.calib_progress.connect(lambda rid, done, total, what: steps.append((done, total, what)))
    with qtbot.waitSignal(win.bridge.calib_finished, timeout=WAIT_MS) as sig:
        view.calibrate({"passes": 1, "context": 64, "overhead_rounds": 2})
    curves = sig.args[1]
    assert curves["mode"] == "lookup" and curves["widths"][0] == 1
    assert len(curves["verify_ms"]) == len(curves["widths"]) and all(v > 0 for v in curves["verify_ms"])
    assert steps[-1][0] == steps[-1][1] > len(curves["widths"])  # progress reached the end
    assert curves["bandwidth"] > 0 and win.bridge.telemetry.snapshot().model["bandwidth"] == curves["bandwidth"]
    qtbot.waitUntil(lambda: view.drawn_version == win.bridge.telemetry.snapshot().version, timeout=WAIT_MS)
    xs, ys = view.verify_line.getData()
    assert list(xs) == curves["widths"] and list(ys) == curves["verify_fit"]
    assert view.cap_line.isVisible() and view.cap_line.value() == curves["default_cap"] + 1
    assert view.calib_id is None and "calibrated" in view.calib_status.text()
    assert (tmp_path / "tandem" / "calibration.json").exists()  # the calibrator cached it


def test_calibrate_can_be_cancelled(win, qtbot):
    view = win.telemetry
    first = []

    def on_progress(rid, done, total, what):
        if not first:
            first.append(done)
            view.calibrate()  # a second click on the button cancels

    win.bridge.calib_progress.connect(on_progress)
    with qtbot.waitSignal(win.bridge.calib_failed, timeout=WAIT_MS) as sig:
        view.calibrate({"passes": 50, "context": 64})
    assert sig.args[1] == "cancelled" and view.calib_id is None
    assert win.bridge.telemetry.snapshot().calibration is None


# -- models ----------------------------------------------------------------------------------------------
def rows(win) -> dict[str, list[str]]:
    t = win.models.table
    return {t.topLevelItem(i).data(0, 0x0100): [t.topLevelItem(i).text(c) for c in range(t.columnCount())]
            for i in range(t.topLevelItemCount())}


def settled(qtbot, models) -> None:
    """Background scans and Hub calls answered (they run on their own threads)."""
    qtbot.waitUntil(lambda: not models.busy, timeout=WAIT_MS)


def evict(qtbot, models, key: str, answer: bool = True) -> list[str]:
    """Select a row and press Evict; returns what the confirmation asked (empty: refused first)."""
    asked = []
    models.confirm = lambda title, text: asked.append(text) or answer
    settled(qtbot, models)
    assert models.select(key)
    models.evict_selected()
    settled(qtbot, models)
    return asked


def test_models_lists_the_cache_and_evicts_with_confirmation(win, qtbot, tmp_path):
    models = win.models
    settled(qtbot, models)
    r = rows(win)
    assert r[TARGET][1:4] == ["hf-cache", "target", "safetensors"] and r[DRAFTER][1:3] == ["hf-cache", "drafter"]
    assert r["smollm2-135m"][1] == "built-in"
    repo_dir = tmp_path / "hub" / "models--org--tiny-dspark"
    asked = evict(qtbot, models, DRAFTER, answer=False)  # the user says Cancel
    assert repo_dir.exists() and "frees" in asked[0]
    assert evict(qtbot, models, DRAFTER)
    settled(qtbot, models)
    assert not repo_dir.exists() and DRAFTER not in rows(win) and "evicted" in models.detail.text()


def test_models_refuses_to_evict_the_loaded_model(win, qtbot, tmp_path):
    settled(qtbot, win.models)
    with qtbot.waitSignal(win.bridge.model_loaded, timeout=WAIT_MS):
        assert win.models.select(TARGET)
        win.models.load_selected()
    assert rows(win)[TARGET][-1] == "loaded"
    assert evict(qtbot, win.models, TARGET) == []
    assert "loaded right now" in win.models.detail.text()
    assert (tmp_path / "hub" / "models--org--tiny-target").exists()


def test_models_refuses_to_evict_a_model_being_loaded(win, qtbot, tmp_path):
    """Evicting the model the worker is loading would delete its files under the load."""
    release = threading.Event()

    def slow_load(spec, drafter):
        release.wait(WAIT_MS / 1000)
        return tiny_engine()

    win.host.worker.factory = slow_load
    settled(qtbot, win.models)
    with qtbot.waitSignal(win.bridge.model_loading, timeout=WAIT_MS):
        assert win.models.select(TARGET)
        win.models.load_selected()
    assert rows(win)[TARGET][-1] == "loading…"
    try:
        assert evict(qtbot, win.models, TARGET) == []
        assert "being loaded right now" in win.models.detail.text()
        assert (tmp_path / "hub" / "models--org--tiny-target").exists()
    finally:
        release.set()
    qtbot.waitUntil(lambda: not win.bridge.pending_loads, timeout=WAIT_MS)


def test_models_refuses_to_evict_a_model_being_downloaded(win, qtbot, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from tests.test_app_hub import FILES

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    models, panel = win.models, win.models.hub_panel
    hold = threading.Event()  # the weights stall after their first chunk: the download stays in flight
    with FakeHub(FILES, hold=hold) as fake:
        models.endpoint = fake.url
        job = models.start_download("org/fresh")
        try:
            qtbot.waitUntil(lambda: "of 2 files" in panel.status.text(), timeout=WAIT_MS)  # config.json came
            models.refresh()
            qtbot.waitUntil(lambda: "org/fresh" in rows(win), timeout=WAIT_MS)  # the partial download is listed
            assert job.running and rows(win)["org/fresh"][-1] == "downloading…"
            assert evict(qtbot, models, "org/fresh") == []  # refused before asking
            assert "being downloaded right now" in models.detail.text()
            assert (tmp_path / "hub" / "models--org--fresh").exists()
            panel.cancel_download()
        finally:
            hold.set()
        qtbot.waitUntil(lambda: not job.running, timeout=WAIT_MS)
    assert "cancelled" in panel.status.text()


def test_models_scans_off_the_gui_thread(win, qtbot, monkeypatch):
    """The refresh used to run scan_cache_dir and a snapshot_download per repo on the GUI thread."""
    from app import hub

    seen = []
    real = hub.list_models

    def slow_list(*args, **kwargs):
        seen.append(threading.current_thread())
        time.sleep(0.5)  # a slow disk or a huge cache
        return real(*args, **kwargs)

    settled(qtbot, win.models)
    monkeypatch.setattr(hub, "list_models", slow_list)
    t0 = time.perf_counter()
    win.models.refresh()
    assert time.perf_counter() - t0 < 0.3  # the GUI thread did not wait for the scan
    settled(qtbot, win.models)
    assert seen and seen[0] is not threading.main_thread() and TARGET in rows(win)


def test_models_download_offline_is_a_clean_error(win, qtbot, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    panel = win.models.hub_panel
    panel.search_input.setText("org/absent")
    assert panel.download_button.isEnabled()  # a typed repo id can be downloaded directly
    panel.download_button.click()
    settled(qtbot, win.models)
    qtbot.waitUntil(lambda: panel.download_button.isEnabled(), timeout=WAIT_MS)
    assert "offline" in panel.status.text() and "org/absent" in panel.status.text()
    assert panel.progress.value() == 0


def test_models_download_shows_progress_and_lands_in_the_table(win, qtbot, monkeypatch):
    from huggingface_hub import constants

    from tests.test_app_hub import FILES

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    models = win.models
    with FakeHub(FILES) as fake:
        models.endpoint = fake.url
        with qtbot.waitSignal(models.hub_panel.progress.valueChanged, timeout=WAIT_MS):
            job = models.start_download("org/fresh")
        qtbot.waitUntil(lambda: not job.running, timeout=WAIT_MS)
        settled(qtbot, models)
    panel = models.hub_panel
    assert panel.progress.value() == 1000 and "in the cache" in panel.status.text()
    qtbot.waitUntil(lambda: models.selected_entry() is not None, timeout=WAIT_MS)
    assert rows(win)["org/fresh"][1:3] == ["hf-cache", "target"]
    assert models.selected_entry().name == "org/fresh"


def test_models_search_picks_a_gguf_file_and_downloads_only_it(win, qtbot, monkeypatch):
    from huggingface_hub import constants

    from tests.test_app_stores import GGUF_REPO, MLX_REPO

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    models, panel = win.models, win.models.hub_panel
    quants = {"Tiny-Q8_0.gguf": b"GGUF" + b"\x01" * 4000, "Tiny-Q4_K_M.gguf": b"GGUF" + b"\x02" * 2000}
    repo = dict(GGUF_REPO, id="org/Tiny-GGUF")
    with FakeHub(quants, models=[MLX_REPO, repo],
                 repo_files={repo["id"]: {k: len(v) for k, v in quants.items()}}) as fake:
        models.endpoint = fake.url
        panel.search_input.setText("tiny")
        panel.format.setCurrentText("GGUF")
        panel.search_button.click()
        settled(qtbot, models)
        assert [panel.table.topLevelItem(i).text(0) for i in range(panel.table.topLevelItemCount())] == [repo["id"]]
        assert "600.0M" == panel.table.topLevelItem(0).text(2)
        assert panel.select(repo["id"])
        settled(qtbot, models)  # the file list comes on demand
        assert panel.file.isVisible() or not panel.isVisible()
        assert panel.file.currentData() == ("Tiny-Q4_K_M.gguf", len(quants["Tiny-Q4_K_M.gguf"]))  # Q4_K_M first
        assert panel.table.topLevelItem(0).text(3) == "2.0 KB"
        job = panel.start_download()
        qtbot.waitUntil(lambda: not job.running, timeout=WAIT_MS)
        settled(qtbot, models)
    key = f"{repo['id']}/Tiny-Q4_K_M.gguf"
    qtbot.waitUntil(lambda: key in rows(win), timeout=WAIT_MS)
    row = models.selected_entry()
    assert row is not None and row.key == key and row.format == "GGUF" and row.load_spec.endswith("Tiny-Q4_K_M.gguf")
    assert not any(k.endswith("Q8_0.gguf") for k in rows(win))  # only the chosen quantization came
    assert rows(win)[key][-1] == "can't load"  # not a real model: its header is unreadable
    assert "not a readable GGUF" in row.problem


def test_models_search_error_is_one_line_and_the_tab_keeps_working(win, qtbot, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    models, panel = win.models, win.models.hub_panel
    models.endpoint = "http://127.0.0.1:9"
    panel.search_input.setText("qwen")
    panel.search()
    settled(qtbot, models)
    assert panel.status.text().startswith("offline: cannot reach 127.0.0.1:9") and "\n" not in panel.status.text()
    assert panel.search_button.isEnabled()
    models.refresh()
    settled(qtbot, models)
    assert TARGET in rows(win)


def test_models_lists_and_loads_an_ollama_model(qtbot, tmp_path, monkeypatch):
    """An Ollama blob (no .gguf name) loads through the real GGUF path: linked, converted, loaded."""
    from tests.test_app_stores import build_stores

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "tandem"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    build_stores(tmp_path / "home")

    def real_loader(spec, drafter):
        if spec is None:
            return tiny_engine()
        from engine.api import load

        return load(spec)

    w = MainWindow(engine_factory=real_loader, cache_dir=str(tmp_path / "hub"))
    qtbot.addWidget(w)
    try:
        qtbot.waitUntil(lambda: w.chat.model_ready, timeout=WAIT_MS)
        settled(qtbot, w.models)
        r = rows(w)
        assert r["tinyllama:latest"][1:4] == ["Ollama", "target", "GGUF · llama"]
        assert r["old/Gemma-GGUF/gemma.gguf"][-1] == "can't load"
        assert w.models.select("tinyllama:latest")
        assert w.models.load_button.isEnabled()
        with qtbot.waitSignal(w.bridge.model_loaded, timeout=WAIT_MS) as sig:
            w.models.load_selected()
        info = sig.args[0]
        assert info["name"] == "tinyllama-latest" and info["source"].startswith("gguf:")
        assert info["source"].split(":", 1)[1] == w.models.selected_entry().path  # the blob itself
        qtbot.waitUntil(lambda: rows(w)["tinyllama:latest"][-1] == "loaded", timeout=WAIT_MS)
        assert ask(qtbot, w, "hello", "baseline", 3)["tokens"] <= 3
    finally:
        w.shutdown()


# -- closing and stopping ---------------------------------------------------------------------------------
def test_stop_interrupts_a_long_prefill():
    """Stop (or closing) during the prefill of a long prompt ends it after the chunk in flight;
    the worker passed no prefill hook, so a Stop waited for the whole prompt."""
    eng = tiny_engine()
    bridge = Bridge()
    worker = EngineWorker(bridge, None)
    worker.engine = eng
    failed, finished, chunks = [], [], []
    bridge.gen_failed.connect(lambda rid, msg: failed.append(msg))
    bridge.gen_finished.connect(lambda rid, result: finished.append(result))
    rid = bridge.next_id()
    real_forward = eng.target.forward

    def forward(ids, cache, **kw):
        chunks.append(int(ids.shape[1]))
        if len(chunks) == 1:
            bridge.cancel(rid)  # the user presses Stop while the first chunk runs
        return real_forward(ids, cache, **kw)

    eng.target.forward = forward
    prompt = " ".join(f"w{5 + i % 90}" for i in range(3 * 512 + 10))  # four prefill chunks
    worker.generate(rid, prompt, {"mode": "lookup", "max_new_tokens": 50})
    assert failed == ["cancelled"] and finished == []
    assert chunks == [512]  # nothing ran after the Stop


def test_closing_during_an_uninterruptible_load_is_prompt(win, qtbot):
    """A load cannot be interrupted: closing used to block the GUI thread until it ended (up to
    60 s), then Qt aborted if it was still running. Now the window goes at once and the worker
    is kept alive until it ends."""
    release = threading.Event()
    releaser = threading.Timer(8.0, release.set)  # the old code returned only when this fired

    def slow_load(spec, drafter):
        release.wait(WAIT_MS / 1000)
        return tiny_engine()

    win.host.worker.factory = slow_load
    with qtbot.waitSignal(win.bridge.model_loading, timeout=WAIT_MS):
        win.bridge.load("org/slow")
    releaser.start()
    try:
        t0 = time.perf_counter()
        win.close()
        took = time.perf_counter() - t0
        assert took < 5 and win.isHidden()
        assert win.host.thread.isRunning()  # still loading: kept alive, never destroyed running
    finally:
        release.set()
        releaser.cancel()
    qtbot.waitUntil(lambda: not win.host.thread.isRunning(), timeout=WAIT_MS)
