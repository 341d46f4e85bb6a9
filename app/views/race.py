"""Race tab: one prompt, several decoders, run one after the other on the worker (same settings,
fresh caches), then replayed side by side at their true speed from per-token timestamps. Each
token is coloured by how it was produced (an accepted lookup or drafter draft, or the target's
own token), with the token diff against baseline on top, and a verdict."""

from __future__ import annotations

import html
import time
from typing import Optional

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QColor, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QCheckBox, QFrame, QGridLayout, QLabel, QPlainTextEdit, QProgressBar, QPushButton,
                               QSpinBox, QVBoxLayout, QWidget)

from app.bridge import Bridge
from app.race_verdict import replay_length, speedup, token_diff, visible_tokens
from app.views.common import (ACCENT, LANE_COLOURS, MODE_HELP, Card, fmt_rate, fmt_seconds, hbox, plain_label,
                              set_tone, spin, title_label)
from app.views.markdown_view import STREAM_RENDER_MS, MarkdownView
from app.views.token_colours import legend, source_summary, token_format

RACE_MODES = ("lookup", "draft", "dspark", "dflash")
DEFAULT_PROMPT = ("Write a Python function that checks whether a string is a palindrome, "
                  "then explain how it works.")
REPLAY_HZ = 30


class Lane(QFrame):
    def __init__(self, index: int, mode: str):
        super().__init__()
        self.setObjectName("lane")
        self.index = index
        self.mode = mode
        self.data: Optional[dict] = None
        self.diff: list[str] = []
        self.live_text = ""
        self.shown = -1  # tokens painted in the body by render_upto (-1: it shows something else)
        self.caret = False  # a caret glyph follows the tokens shown
        lay = QVBoxLayout(self)
        lay.setContentsMargins(12, 10, 12, 10)
        lay.setSpacing(6)
        colour = LANE_COLOURS[index % len(LANE_COLOURS)]
        self.name = QLabel(f"<span style='color:{colour}'>●</span>&nbsp;<b>{html.escape(mode)}</b>")
        self.name.setObjectName("laneName")
        self.speed = QLabel("queued")
        self.speed.setObjectName("laneSpeed")
        lay.addLayout(hbox(self.name, None, self.speed))
        self.meta = plain_label("", "laneMeta")
        lay.addWidget(self.meta)
        self.body = MarkdownView("laneBody", auto_height=False)
        self._live_timer = QTimer(self)  # live text is rendered at most every STREAM_RENDER_MS
        self._live_timer.setSingleShot(True)
        self._live_timer.setInterval(STREAM_RENDER_MS)
        self._live_timer.timeout.connect(self._render_live)
        self.markdown = False  # the replay renders Markdown instead of coloured tokens
        lay.addWidget(self.body, 1)
        self.verdict = plain_label("", "laneVerdict")
        lay.addWidget(self.verdict)

    def start(self) -> None:
        self.speed.setText("running…")

    def append_live(self, text: str) -> None:
        self.live_text += text
        self.shown = -1
        if not self._live_timer.isActive():
            self._live_timer.start()

    def _render_live(self) -> None:
        self.body.set_markdown(self.live_text)
        bar = self.body.verticalScrollBar()
        bar.setValue(bar.maximum())

    def finish(self, data: dict, baseline_tps: float) -> None:
        self.data = data
        if self._live_timer.isActive():  # the last live text, rendered now
            self._live_timer.stop()
            self._render_live()
        if "error" in data:
            self.speed.setText("failed")
            self.meta.setText("")
            self.body.setPlainText("")
            self.verdict.setText(data["error"])
            set_tone(self.verdict, "bad")
            return
        tps = data.get("decode_tps") or 0.0
        sp = speedup(tps, baseline_tps) if self.index else None
        self.speed.setText(fmt_rate(tps) + (f"  ·  {sp:.2f}×" if sp else ""))
        bits = [f"{data.get('tokens', 0)} tokens", f"TTFT {fmt_seconds(data.get('ttft_s'))}"]
        if data.get("mode") != "baseline":
            bits.append(f"{data.get('mean_accepted', 0):.2f} tok/round")
            bits.append(f"cap {data.get('cap')}")
            if share := source_summary(data.get("sources") or []):
                bits.append(share)
        if data.get("mode") != self.mode:
            bits.append(f"ran as {data.get('mode')}")
        self.meta.setText("  ·  ".join(bits))

    def set_verdict(self, v: Optional[dict], baseline_ids: list[int]) -> None:
        if self.data is None or "error" in self.data:
            return
        self.diff = token_diff(baseline_ids, self.data["token_ids"]) if self.index else []
        self.shown = -1  # repaint with the diff
        if self.index == 0:
            self.verdict.setText("reference lane")
            set_tone(self.verdict, "muted")
        elif v is not None:
            clean = v["status"] in ("identical", "cancelled")
            self.verdict.setText(("✓ " if clean else "≈ " if v["ok"] else "✗ ") + v["text"])
            set_tone(self.verdict, "good" if clean else ("warn" if v["ok"] else "bad"))

    def render_upto(self, n: int) -> None:
        """Show the first n tokens, each coloured by its source and its diff state against baseline.
        Appends to what is shown (the replay grows it every tick); repaints only when going back."""
        if self.data is None or "error" in self.data:
            return
        pieces = self.data.get("pieces") or []
        sources = self.data.get("sources") or []
        n = max(0, min(n, len(pieces)))
        if self.markdown:
            self.shown, self.caret = -1, False
            self.body.set_markdown("".join(pieces[:n]))
            bar = self.body.verticalScrollBar()
            bar.setValue(bar.maximum())
            return
        if self.shown < 0 or n < self.shown:
            self.body.clear()
            cursor = QTextCursor(self.body.document())
            block = QTextBlockFormat()
            block.setLineHeight(140, QTextBlockFormat.LineHeightTypes.ProportionalHeight.value)
            cursor.setBlockFormat(block)
            self.shown, self.caret = 0, False
        cursor = QTextCursor(self.body.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if self.caret:  # the caret glyph sits after the last token shown
            cursor.deletePreviousChar()
            self.caret = False
        for i in range(self.shown, n):
            cursor.insertText(pieces[i], token_format(sources[i] if i < len(sources) else "target",
                                                      self.diff[i] if i < len(self.diff) else "same"))
        self.shown = n
        if n < len(pieces):
            caret = QTextCharFormat()
            caret.setForeground(QColor(ACCENT))
            cursor.insertText("▍", caret)
            self.caret = True
        bar = self.body.verticalScrollBar()
        bar.setValue(bar.maximum())


class RaceView(QWidget):
    def __init__(self, bridge: Bridge, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.bridge = bridge
        self.request_id: Optional[int] = None
        self.lanes: list[Lane] = []
        self.result: Optional[dict] = None
        self.replay_t0 = 0.0
        self.replay_total = 0.0
        self.replay_timer = QTimer(self)
        self.replay_timer.setInterval(int(1000 / REPLAY_HZ))
        self.replay_timer.timeout.connect(self._tick)

        root = QVBoxLayout(self)
        root.setContentsMargins(20, 16, 20, 16)
        root.setSpacing(12)
        root.addWidget(title_label("Race", "Same prompt, same settings, one decoder after another on a fresh "
                                           "cache; then replayed side by side at true speed. Greedy output must "
                                           "match baseline token for token."))

        setup = Card()
        self.prompt = QPlainTextEdit(DEFAULT_PROMPT)
        self.prompt.setObjectName("prompt")
        self.prompt.setFixedHeight(64)
        setup.body.addWidget(self.prompt)
        self.checks: dict[str, QCheckBox] = {}
        row = [plain_label("baseline  +", "fieldLabel", wrap=False)]
        for mode in RACE_MODES:
            box = QCheckBox(mode)
            box.setToolTip(MODE_HELP[mode])
            box.setChecked(mode == "lookup")
            self.checks[mode] = box
            row.append(box)
        self.max_tokens = spin(QSpinBox, 8, 2048, 128, 32)
        self.run_button = QPushButton("Run race")
        self.run_button.setObjectName("primary")
        self.run_button.clicked.connect(self._run_or_stop)
        self.replay_button = QPushButton("Replay")
        self.replay_button.setObjectName("secondary")
        self.replay_button.setEnabled(False)
        self.replay_button.clicked.connect(self.replay)
        self.markdown_box = QCheckBox("Markdown")
        self.markdown_box.setToolTip("Show the answers rendered as Markdown instead of tokens coloured by source "
                                     "and diff")
        self.markdown_box.toggled.connect(self._set_markdown)
        row += [None, self.markdown_box, plain_label("Max tokens", "fieldLabel", wrap=False), self.max_tokens,
                self.replay_button, self.run_button]
        setup.body.addLayout(hbox(*row))
        root.addWidget(setup)

        self.timeline = QProgressBar()
        self.timeline.setObjectName("timeline")
        self.timeline.setRange(0, 1000)
        self.timeline.setValue(0)
        self.timeline.setFormat("")
        self.timeline.setFixedHeight(14)
        self.timeline.setTextVisible(False)
        self.clock = plain_label("", "hint", wrap=False)
        root.addLayout(hbox(self.timeline, self.clock))
        self.legend = legend()
        root.addWidget(self.legend)

        self.lanes_holder = QWidget()
        self.lanes_layout = QGridLayout(self.lanes_holder)
        self.lanes_layout.setContentsMargins(0, 0, 0, 0)
        self.lanes_layout.setSpacing(10)
        self.placeholder = plain_label("Pick decoders and press Run race.", "welcome")
        self.placeholder.setAlignment(Qt.AlignCenter)
        self.lanes_layout.addWidget(self.placeholder, 0, 0)
        root.addWidget(self.lanes_holder, 1)

        self.summary = plain_label("", "verdict")
        root.addWidget(self.summary)

        b = bridge
        b.race_lane_started.connect(self._on_lane_started)
        b.race_lane_text.connect(self._on_lane_text)
        b.race_lane_finished.connect(self._on_lane_finished)
        b.race_finished.connect(self._on_finished)

    # -- actions -------------------------------------------------------------------------------
    def modes(self) -> list[str]:
        return ["baseline"] + [m for m, box in self.checks.items() if box.isChecked()]

    def _run_or_stop(self) -> None:
        if self.request_id is not None:
            self.bridge.cancel(self.request_id)
            self.summary.setText("stopping after this round…")
        else:
            self.run()

    def run(self, prompt: Optional[str] = None, modes: Optional[list[str]] = None,
            params: Optional[dict] = None) -> Optional[int]:
        if self.request_id is not None:
            return None
        prompt = (prompt or self.prompt.toPlainText()).strip()
        if not prompt:
            return None
        modes = modes or self.modes()
        if "baseline" not in modes:
            modes = ["baseline"] + modes
        self.replay_timer.stop()
        self._make_lanes(modes)
        self.result = None
        params = dict(params or {}, max_new_tokens=self.max_tokens.value(), temperature=0.0)
        self.request_id = self.bridge.race(prompt, modes, params)
        self.run_button.setText("Stop")
        self.run_button.setObjectName("danger")
        self._repolish(self.run_button)
        self.replay_button.setEnabled(False)
        self.summary.setText(f"running {len(modes)} lanes one after another…")
        set_tone(self.summary, "")
        return self.request_id

    def _make_lanes(self, modes: list[str]) -> None:
        while self.lanes_layout.count():
            item = self.lanes_layout.takeAt(0)
            w = item.widget()
            if w is not None and w is not self.placeholder:
                w.deleteLater()
        self.placeholder.hide()
        self.lanes = [Lane(i, m) for i, m in enumerate(modes)]
        for lane in self.lanes:
            lane.markdown = self.markdown_box.isChecked()
        cols = len(modes) if len(modes) <= 3 else (len(modes) + 1) // 2
        for i, lane in enumerate(self.lanes):
            self.lanes_layout.addWidget(lane, i // cols, i % cols)

    def _set_markdown(self, on: bool) -> None:
        self.legend.setVisible(not on)
        for lane in self.lanes:
            lane.markdown = on
            if lane.data and "error" not in lane.data and not self.replay_timer.isActive():
                lane.render_upto(len(lane.data["token_ids"]))

    @staticmethod
    def _repolish(w: QWidget) -> None:
        w.style().unpolish(w)
        w.style().polish(w)

    def replay(self) -> None:
        if not self.result:
            return
        ok = [lane for lane in self.lanes if lane.data and "error" not in lane.data]
        self.replay_total = replay_length([lane.data["token_times"] for lane in ok])
        self.replay_t0 = time.perf_counter()
        for lane in ok:
            lane.render_upto(0)
        self.replay_timer.start()

    def _tick(self) -> None:
        t = time.perf_counter() - self.replay_t0
        done = t >= self.replay_total
        for lane in self.lanes:
            if lane.data and "error" not in lane.data:
                lane.render_upto(len(lane.data["token_ids"]) if done else visible_tokens(lane.data["token_times"], t))
        frac = min(t / self.replay_total, 1.0) if self.replay_total > 0 else 1.0
        self.timeline.setValue(int(1000 * frac))
        self.clock.setText(f"{min(t, self.replay_total):.2f} s / {self.replay_total:.2f} s")
        if done:
            self.replay_timer.stop()

    # -- worker replies -----------------------------------------------------------------------------
    def _on_lane_started(self, rid: int, i: int, mode: str) -> None:
        if rid == self.request_id and i < len(self.lanes):
            self.lanes[i].start()
            self.summary.setText(f"lane {i + 1} of {len(self.lanes)}: {mode}…")

    def _on_lane_text(self, rid: int, i: int, text: str) -> None:
        if rid == self.request_id and i < len(self.lanes):
            self.lanes[i].append_live(text)

    def _on_lane_finished(self, rid: int, i: int, data: dict) -> None:
        if rid != self.request_id or i >= len(self.lanes):
            return
        base = self.lanes[0].data if self.lanes[0].data else data
        self.lanes[i].finish(data, (base or {}).get("decode_tps") or 0.0)

    def _on_finished(self, rid: int, result: dict) -> None:
        if rid != self.request_id:
            return
        self.request_id = None
        self.result = result
        self.run_button.setText("Run race")
        self.run_button.setObjectName("primary")
        self._repolish(self.run_button)
        lanes = result.get("lanes") or []
        verdicts = result.get("verdicts") or []
        base_ids = lanes[0].get("token_ids", []) if lanes and "error" not in lanes[0] else []
        for lane, v in zip(self.lanes, verdicts + [None] * (len(self.lanes) - len(verdicts))):
            lane.set_verdict(v, base_ids)
        self.summary.setText(self.summary_text(result))
        bad = [v for v in verdicts if v and not v["ok"]]
        set_tone(self.summary, "bad" if bad or result.get("error") else "good")
        self.replay_button.setEnabled(any(lane.data and "error" not in lane.data for lane in self.lanes))
        self.replay()

    @staticmethod
    def summary_text(result: dict) -> str:
        if result.get("error"):
            return f"race failed: {result['error']}"
        lanes = result.get("lanes") or []
        verdicts = result.get("verdicts") or []
        if not lanes or "error" in lanes[0]:
            return "baseline failed; nothing to compare against"
        base_tps = lanes[0].get("decode_tps") or 0.0
        parts = []
        for lane, v in zip(lanes[1:], verdicts[1:]):
            if "error" in lane:
                parts.append(f"{lane['mode']}: failed")
                continue
            sp = speedup(lane.get("decode_tps") or 0.0, base_tps)
            state = v["status"] if v else "?"
            if v and v["status"] == "diverged":
                state = "diverged at a floating-point tie" if v["ok"] else "diverged: a real bug"
            name = lane.get("mode_requested", lane["mode"])
            parts.append(f"{name}: {state}" + (f", {sp:.2f}× baseline" if sp else ""))
        return "Verdict — " + ("; ".join(parts) if parts else "baseline only")

    def shutdown(self) -> None:
        self.replay_timer.stop()
