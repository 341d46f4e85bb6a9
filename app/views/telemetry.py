"""Telemetry tab: live roofline, acceptance per round, the verify cost curve, and the requests
decoding together (the chat's and the local server's: each one's rounds and batch width).

Plots redraw on a fixed ~10 Hz timer from the bridge's bounded telemetry buffer (filled by the
worker thread), never per token, so decoding never waits on the GUI.
"""

from __future__ import annotations

import os
from typing import Optional

os.environ.setdefault("PYQTGRAPH_QT_LIB", "PySide6")

import pyqtgraph as pg  # noqa: E402
from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import (QGridLayout, QProgressBar, QPushButton, QTreeWidgetItem, QVBoxLayout,  # noqa: E402
                               QWidget)

from app import theme  # noqa: E402
from app.bridge import Bridge  # noqa: E402
from app.telemetry_model import acceptance_series, ceiling_curve, ceiling_tps, live_tps  # noqa: E402
from app.views.common import (ACCENT, ACCENT_SOFT, GOOD, MUTED, WARN, Card, Stat, hbox, model_table,  # noqa: E402
                              plain_label, set_tone, title_label)

REDRAW_MS = 100
ACCEPT_WINDOW = 160  # rounds shown in the acceptance plot
REQUEST_COLUMNS = ("Request", "Mode", "Rounds", "Tokens", "Tokens/round", "Batch width", "State")

pg.setConfigOptions(antialias=True)


def _plot(title: str, left: str, bottom: str) -> pg.PlotWidget:
    w = pg.PlotWidget()
    w.setMinimumHeight(200)
    item = w.getPlotItem()
    item.setTitle(title)
    item.setLabel("left", left)
    item.setLabel("bottom", bottom)
    item.showGrid(x=True, y=True, alpha=0.15)
    item.setMenuEnabled(False)
    return w


def style_plot(w: pg.PlotWidget, colours: dict) -> None:
    """Paint a plot in a theme's colours: background, title, axes and legend."""
    w.setBackground(colours["surface"])
    item = w.getPlotItem()
    item.titleLabel.setText(item.titleLabel.text, size="11pt", color=colours["text_strong"])
    for name in ("left", "bottom"):
        axis = item.getAxis(name)
        axis.setPen(pg.mkPen(colours["border_strong"]))
        axis.setTextPen(pg.mkPen(colours["text_soft"]))
        axis.setLabel(axis.labelText, color=colours["text_soft"])
    legend = item.legend
    if legend is not None:
        fill = pg.mkColor(colours["surface"])
        fill.setAlpha(230)  # the curves show faintly through
        legend.setBrush(pg.mkBrush(fill))
        legend.setPen(pg.mkPen(colours["border"]))
        legend.setLabelTextColor(colours["text"])
        for _, label in legend.items:
            label.setText(label.text, color=colours["text"])


class TelemetryView(QWidget):
    def __init__(self, bridge: Bridge, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.bridge = bridge
        self.drawn_version = -1
        self.redraws = 0
        self.calib_id: Optional[int] = None

        root = QVBoxLayout(self)
        root.setContentsMargins(20, 16, 20, 16)
        root.setSpacing(12)
        self.calibrate_button = QPushButton("Calibrate this machine")
        self.calibrate_button.setObjectName("primary")
        self.calibrate_button.clicked.connect(lambda: self.calibrate())
        self.calib_bar = QProgressBar()
        self.calib_bar.setFixedWidth(220)
        self.calib_bar.setRange(0, 1)
        self.calib_bar.setValue(0)
        self.calib_bar.setFormat("")
        self.calib_status = plain_label("", "hint", wrap=False)
        subtitle = "Live from the engine while it generates (Chat, Race or the local server)."
        root.addLayout(hbox((title_label("Telemetry", subtitle), 1),
                            self.calib_status, self.calib_bar, self.calibrate_button))

        stats = hbox(spacing=10)
        self.stat_live = Stat("decode tok/s (live)")
        self.stat_ceiling = Stat("bandwidth ceiling tok/s")
        self.stat_roof = Stat("× roofline")
        self.stat_tau = Stat("tokens per round")
        self.stat_bw = Stat("memory bandwidth")
        self.stat_batch = Stat("batch width")
        self.stat_batch.setToolTip("requests sharing each target forward now (the chat's and the local server's)")
        for s in (self.stat_live, self.stat_ceiling, self.stat_roof, self.stat_tau, self.stat_bw, self.stat_batch):
            stats.addWidget(s)
        root.addLayout(stats)

        grid = QGridLayout()
        grid.setSpacing(12)
        roof_card, acc_card, cost_card = Card(), Card(), Card()
        self.roof_plot = _plot("Roofline", "tok/s", "context (tokens)")
        self.roof_plot.addLegend(offset=(-10, 10), labelTextSize="9pt")
        self.ceiling_line = self.roof_plot.plot([], [], pen=pg.mkPen(MUTED, width=2, style=pg.QtCore.Qt.DashLine),
                                                name="bandwidth ceiling")
        self.base_points = pg.ScatterPlotItem(size=10, brush=pg.mkBrush(MUTED), name="baseline")
        self.spec_points = pg.ScatterPlotItem(size=11, brush=pg.mkBrush(ACCENT), symbol="d",
                                              name="speculative")
        self.live_point = pg.ScatterPlotItem(size=14, brush=pg.mkBrush(WARN), symbol="star",
                                             name="current run")
        for item in (self.base_points, self.spec_points, self.live_point):
            self.roof_plot.addItem(item)
        roof_card.body.addWidget(self.roof_plot)

        self.acc_plot = _plot("Acceptance per round", "tokens", "round")
        self.acc_plot.addLegend(offset=(-10, 10), labelTextSize="9pt")
        self.drafted_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=pg.mkBrush(ACCENT_SOFT), pen=None,
                                            name="drafted")
        self.accepted_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=pg.mkBrush(ACCENT), pen=None,
                                             name="accepted")
        self.acc_plot.addItem(self.drafted_bars)
        self.acc_plot.addItem(self.accepted_bars)
        self.mean_line = self.acc_plot.plot([], [], pen=pg.mkPen(GOOD, width=2), name="running mean tokens/round")
        acc_card.body.addWidget(self.acc_plot)

        self.cost_plot = _plot("Cost curves (calibration)", "ms", "tokens per target forward (cap + 1)")
        self.cost_plot.addLegend(offset=(10, 10), labelTextSize="9pt")
        self.verify_points = pg.ScatterPlotItem(size=7, brush=pg.mkBrush(ACCENT),
                                                name="verify, measured")
        self.cost_plot.addItem(self.verify_points)
        self.verify_line = self.cost_plot.plot([], [], pen=pg.mkPen(ACCENT, width=2), name="verify, fitted")
        self.per_token_line = self.cost_plot.plot([], [], pen=pg.mkPen(GOOD, width=2, style=pg.QtCore.Qt.DashLine),
                                                  name="verify ms per token if all accepted")
        # in the legend only when the drafter has a model to time (lookup's drafting cost is ~0)
        self.draft_line = self.cost_plot.plot([], [], pen=pg.mkPen(WARN, width=2), symbol="t", symbolSize=6,
                                              symbolBrush=WARN)
        self.cap_line = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen(MUTED, style=pg.QtCore.Qt.DotLine),
                                        label="", labelOpts={"position": 0.55})  # colours: apply_theme
        self.cap_line.hide()
        self.cost_plot.addItem(self.cap_line)
        self.cost_hint = plain_label("Run “Calibrate this machine” to measure how the target's verify cost grows "
                                     "with the number of drafted tokens, and pick the draft cap.", "hint")
        cost_card.body.addWidget(self.cost_plot)
        cost_card.body.addWidget(self.cost_hint)
        self.subtitle = plain_label("", "hint")

        requests_card = Card("Requests")
        self.requests_table = model_table(list(REQUEST_COLUMNS))
        self.requests_table.setSelectionMode(self.requests_table.SelectionMode.NoSelection)
        requests_card.body.addWidget(self.requests_table)

        grid.addWidget(roof_card, 0, 0)
        grid.addWidget(acc_card, 0, 1)
        grid.addWidget(cost_card, 1, 0)
        grid.addWidget(requests_card, 1, 1)
        grid.setRowStretch(0, 3)
        grid.setRowStretch(1, 2)
        root.addLayout(grid, 1)
        root.addWidget(self.subtitle)

        bridge.calib_progress.connect(self._on_calib_progress)
        bridge.calib_finished.connect(self._on_calib_finished)
        bridge.calib_failed.connect(self._on_calib_failed)
        self.apply_theme()
        theme.notifier().changed.connect(self.apply_theme)
        self.timer = QTimer(self)
        self.timer.setInterval(REDRAW_MS)
        self.timer.timeout.connect(self.redraw)
        self.timer.start()

    def apply_theme(self, _name: str = "") -> None:
        """Plots follow the app's theme (pyqtgraph paints its own background, not Qt's palette)."""
        c = theme.colours()
        for plot in (self.roof_plot, self.acc_plot, self.cost_plot):
            style_plot(plot, c)
        for points in (self.base_points, self.spec_points, self.live_point, self.verify_points):
            points.setPen(pg.mkPen(c["surface"]))  # outlines that separate overlapping markers
        self.cap_line.label.fill = pg.mkBrush(pg.mkColor(c["surface"]))
        self.cap_line.label.setColor(c["muted"])

    # -- drawing -------------------------------------------------------------------------------
    def redraw(self, force: bool = False) -> bool:
        """Redraw from the buffer if it changed since the last frame; returns whether it drew."""
        snap = self.bridge.telemetry.snapshot()
        if snap.version == self.drawn_version and not force:
            return False
        self.drawn_version = snap.version
        self.redraws += 1
        self._draw_roofline(snap)
        self._draw_acceptance(snap)
        self._draw_costs(snap)
        self._draw_requests(snap)
        return True

    def _draw_requests(self, snap) -> None:
        """Newest first: each request's rounds, tokens, and the most requests it shared a forward with."""
        self.stat_batch.set(str(snap.batch_width) if snap.batch_width else "–")
        table = self.requests_table
        table.clear()
        for r in reversed(snap.requests):
            rounds = r["rounds"]
            per_round = f"{(r['accepted'] + rounds) / rounds:.2f}" if rounds else "–"
            table.addTopLevelItem(QTreeWidgetItem([r["label"], r["mode"] or "–", str(rounds), str(r["tokens"]),
                                                   per_round, str(r["width"]), r["state"]]))

    def _draw_roofline(self, snap) -> None:
        m = snap.model
        bw = float(m.get("bandwidth") or 0.0)
        weights = float(m.get("weight_bytes") or 0.0)
        kv = m.get("kv") or float(m.get("kv_bytes_per_token") or 0.0)
        contexts = [p["context"] for p in snap.points] + [ev["context"] for ev in snap.rounds[-1:]]
        max_ctx = max([512.0] + [c * 1.25 for c in contexts])
        if bw > 0 and weights > 0:
            xs, ys = ceiling_curve(bw, weights, kv, max_ctx)
            self.ceiling_line.setData(xs, ys)
            self.stat_bw.set(f"{bw / 1e9:.1f} GB/s")
        base = [p for p in snap.points if not p["speculative"]]
        spec = [p for p in snap.points if p["speculative"]]
        self.base_points.setData([p["context"] for p in base], [p["tps"] for p in base])
        self.spec_points.setData([p["context"] for p in spec], [p["tps"] for p in spec],
                                 data=[p["mode"] for p in spec])
        live = live_tps(snap.rounds)
        ctx = snap.rounds[-1]["context"] if snap.rounds else 0
        ceiling = ceiling_tps(bw, weights, kv, ctx) if ctx else ceiling_tps(bw, weights, kv, 0)
        if live:
            self.live_point.setData([ctx], [live])
            self.stat_live.set(f"{live:.1f}")
        else:
            last = snap.points[-1] if snap.points else None
            self.live_point.setData([], [])
            self.stat_live.set(f"{last['tps']:.1f}" if last else "–")
            live = last["tps"] if last else None
            ceiling = ceiling_tps(bw, weights, kv, last["context"]) if last else ceiling
        self.stat_ceiling.set(f"{ceiling:.1f}" if ceiling else "–")
        if live and ceiling:
            ratio = live / ceiling
            self.stat_roof.set(f"{ratio:.2f}×", "good" if ratio >= 1.0 else ("" if ratio >= 0.5 else "warn"))
        else:
            self.stat_roof.set("–")
        name = m.get("name") or "no model"
        self.subtitle.setText(
            f"{name} · {m.get('weight_bytes', 0) / 1e6:.0f} MB streamed per forward ({m.get('dtype', '?')}) · "
            f"KV {m.get('kv_bytes_per_token', 0) / 1e3:.1f} KB/token · ceiling = bandwidth / (weights + KV × "
            f"context); speculation beats it by committing several tokens per forward"
            + (f" · {snap.label}" if snap.label else ""))

    def _draw_acceptance(self, snap) -> None:
        idx, drafted, accepted, mean = acceptance_series(snap.rounds)
        idx, drafted, accepted, mean = (idx[-ACCEPT_WINDOW:], drafted[-ACCEPT_WINDOW:], accepted[-ACCEPT_WINDOW:],
                                        mean[-ACCEPT_WINDOW:])
        self.drafted_bars.setOpts(x=idx, height=drafted, width=0.8)
        self.accepted_bars.setOpts(x=idx, height=accepted, width=0.8)
        self.mean_line.setData(idx, mean)
        self.stat_tau.set(f"{mean[-1]:.2f}" if mean else "–")

    def _draw_costs(self, snap) -> None:
        c = snap.calibration
        if not c:
            for item in (self.verify_points, self.verify_line, self.per_token_line, self.draft_line):
                item.setData([], [])
            self.cap_line.hide()
            return
        widths, verify = c.get("widths") or [], c.get("verify_ms") or []
        fit = c.get("verify_fit") or verify
        self.verify_points.setData(widths, verify)
        self.verify_line.setData(widths, fit)
        self.per_token_line.setData(widths, [v / w for v, w in zip(fit, widths)])
        caps, draft = c.get("draft_caps") or [], c.get("draft_ms") or []
        self.draft_line.setData(caps, draft)
        legend = self.cost_plot.getPlotItem().legend
        legend.removeItem(self.draft_line)
        if draft:
            legend.addItem(self.draft_line, "draft (drafter model)")
        cap = c.get("default_cap")
        if cap is not None:
            self.cap_line.setValue(cap + 1)  # verifying `cap` drafts is a forward over cap + 1 tokens
            self.cap_line.label.setFormat(f"default cap {cap}")
            self.cap_line.show()
        if widths and verify:
            w1, wn = fit[0], fit[-1]
            source = "cached" if c.get("from_cache") else f"measured in {c.get('seconds', 0):.0f} s"
            self.cost_hint.setText(
                f"{c.get('mode')} drafter, context {c.get('context')} ({source}): one forward over {widths[0]} token "
                f"{w1:.1f} ms, over {widths[-1]} tokens {wn:.1f} ms ({wn / w1:.2f}× the cost for "
                f"{widths[-1] / widths[0]:.0f}× the tokens); overhead {c.get('overhead_ms', 0):.1f} ms/round. "
                "Drafting pays while accepted tokens outgrow the extra verify cost.")

    # -- calibration ------------------------------------------------------------------------------
    def calibrate(self, params: Optional[dict] = None) -> Optional[int]:
        """Start a calibration (or cancel the running one). ``params``: engine.calibrate.calibrate
        keyword overrides (passes, context, overhead_rounds)."""
        if self.calib_id is not None:
            self.bridge.cancel(self.calib_id)
            return None
        self.calib_id = self.bridge.calibrate(params)
        self.calibrate_button.setText("Cancel")
        self.calibrate_button.setObjectName("danger")
        self._repolish()
        self.calib_bar.setRange(0, 0)
        self.calib_status.setText("waiting for the engine…")
        set_tone(self.calib_status, "")
        return self.calib_id

    def _repolish(self) -> None:
        self.calibrate_button.style().unpolish(self.calibrate_button)
        self.calibrate_button.style().polish(self.calibrate_button)

    def _on_calib_progress(self, rid: int, done: int, total: int, what: str) -> None:
        if rid != self.calib_id:
            return
        self.calib_bar.setRange(0, max(total, 1))
        self.calib_bar.setValue(done)
        self.calib_status.setText(f"measuring: {what}")

    def _calib_done(self) -> None:
        self.calib_id = None
        self.calibrate_button.setText("Calibrate this machine")
        self.calibrate_button.setObjectName("primary")
        self._repolish()

    def _on_calib_finished(self, rid: int, curves: dict) -> None:
        if rid != self.calib_id:
            return
        self._calib_done()
        self.calib_bar.setRange(0, 1)
        self.calib_bar.setValue(1)
        bw = curves.get("bandwidth") or 0
        self.calib_status.setText(f"calibrated in {curves.get('seconds', 0):.0f} s: {bw / 1e9:.1f} GB/s, "
                                  f"default cap {curves.get('default_cap')}")
        set_tone(self.calib_status, "good")
        self.redraw(force=True)

    def _on_calib_failed(self, rid: int, message: str) -> None:
        if rid != self.calib_id:
            return
        self._calib_done()
        self.calib_bar.setRange(0, 1)
        self.calib_bar.setValue(0)
        self.calib_status.setText(message)
        set_tone(self.calib_status, "bad" if message != "cancelled" else "muted")

    def shutdown(self) -> None:
        self.timer.stop()
