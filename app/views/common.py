"""Small widgets and formatting shared by the tabs (Qt only, no engine)."""

from __future__ import annotations

from typing import Optional

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QTreeWidget,
    QVBoxLayout,
    QWidget,
)

MODES = ("auto", "baseline", "lookup", "draft", "dspark", "dflash", "eagle3", "mtp")  # = engine.generate.MODES (no MLX here)
MODE_HELP = {
    "auto": "the registry's best mode for this model (a drafter on this machine, else lookup)",
    "baseline": "plain decoding, one target forward per token",
    "lookup": "prompt-lookup drafts: copies n-grams from the context (no drafter model)",
    "draft": "a small autoregressive draft model sharing the tokenizer",
    "dspark": "DSpark block drafter on the target's hidden states",
    "dflash": "DFlash block-diffusion drafter (DFlash 2 too)",
    "eagle3": "EAGLE-3 head on the target's hidden states (speculators / SpecForge checkpoints)",
    "mtp": "the model's own multi-token-prediction head (Qwen3.5 / 3.6 / 3.8, Qwen3-Next, DeepSeek-V3, GLM-4.5)",
}
# Colours used by plots and the race diff (kept in one place to match style.qss).
ACCENT = "#3563e9"
ACCENT_SOFT = "#a9bcf5"
GOOD = "#1f9d55"
WARN = "#d97706"
BAD = "#dc2626"
MUTED = "#6b7280"
LANE_COLOURS = ("#6b7280", "#3563e9", "#0d9488", "#9333ea", "#ea580c", "#db2777")


def fmt_rate(value: Optional[float], unit: str = "tok/s") -> str:
    return "–" if value is None or value <= 0 else f"{value:.1f} {unit}"


def fmt_seconds(value: Optional[float]) -> str:
    if value is None:
        return "–"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def turn_stats(result: dict) -> str:
    """The one-line footer under an assistant turn."""
    parts = [f"TTFT {fmt_seconds(result.get('ttft_s'))}", fmt_rate(result.get("decode_tps"))]
    if result.get("mode") != "baseline":
        parts.append(f"{result.get('mean_accepted', 0):.2f} tok/round")
    parts.append(f"mode {result.get('mode', '?')}")
    if result.get("cap"):
        parts.append(f"cap {result.get('cap')}")
    parts.append(f"{result.get('tokens', 0)} tokens")
    if result.get("prompt_tokens"):
        cached = result.get("cached_tokens") or 0
        parts.append(f"prompt {result['prompt_tokens']}" + (f" ({cached} cached)" if cached else ""))
    if result.get("finish_reason") == "cancelled":
        parts.append("stopped")
    elif result.get("finish_reason") == "length":
        parts.append("length limit")
    return "  ·  ".join(parts)


class Card(QFrame):
    """A white rounded panel (styled in style.qss) with an optional title."""

    def __init__(self, title: str = "", parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setObjectName("card")
        self.body = QVBoxLayout(self)
        self.body.setContentsMargins(14, 12, 14, 12)
        self.body.setSpacing(8)
        if title:
            label = QLabel(title)
            label.setObjectName("cardTitle")
            self.body.addWidget(label)


class Stat(QFrame):
    """A big number with a caption, for the telemetry and race headers."""

    def __init__(self, caption: str, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setObjectName("stat")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(12, 8, 12, 8)
        lay.setSpacing(0)
        self.value = QLabel("–")
        self.value.setObjectName("statValue")
        self.caption = QLabel(caption)
        self.caption.setObjectName("statCaption")
        lay.addWidget(self.value)
        lay.addWidget(self.caption)

    def set(self, text: str, tone: str = "") -> None:
        self.value.setText(text)
        self.value.setProperty("tone", tone)
        self.value.style().unpolish(self.value)
        self.value.style().polish(self.value)


def hbox(*widgets, spacing: int = 8, margins=(0, 0, 0, 0), stretch_at: Optional[int] = None) -> QHBoxLayout:
    lay = QHBoxLayout()
    lay.setSpacing(spacing)
    lay.setContentsMargins(*margins)
    for i, w in enumerate(widgets):
        if stretch_at == i:
            lay.addStretch(1)
        if isinstance(w, tuple):  # (widget, stretch factor)
            lay.addWidget(w[0], w[1])
        elif isinstance(w, QWidget):
            lay.addWidget(w)
        elif w is None:
            lay.addStretch(1)
        else:
            lay.addLayout(w)
    return lay


def title_label(text: str, sub: str = "") -> QWidget:
    w = QWidget()
    lay = QVBoxLayout(w)
    lay.setContentsMargins(0, 0, 0, 0)
    lay.setSpacing(2)
    t = QLabel(text)
    t.setObjectName("pageTitle")
    lay.addWidget(t)
    if sub:
        s = QLabel(sub)
        s.setObjectName("pageSubtitle")
        s.setWordWrap(True)
        lay.addWidget(s)
    return w


def set_tone(label: QLabel, tone: str) -> None:
    """tone: "", "good", "warn", "bad", "muted" (colours in style.qss)."""
    label.setProperty("tone", tone)
    label.style().unpolish(label)
    label.style().polish(label)


def plain_label(text: str = "", object_name: str = "", wrap: bool = True) -> QLabel:
    label = QLabel(text)
    label.setTextFormat(Qt.PlainText)
    label.setWordWrap(wrap)
    if object_name:
        label.setObjectName(object_name)
    return label


def spin(cls, lo, hi, value, step, decimals: int = 2):
    """A QSpinBox/QDoubleSpinBox with range first, then value (kwargs order would clamp)."""
    box = cls()
    if hasattr(box, "setDecimals"):
        box.setDecimals(decimals)
    box.setRange(lo, hi)
    box.setSingleStep(step)
    box.setValue(value)
    return box


def model_table(columns: list[str]) -> QTreeWidget:
    """A flat, single-selection table of models: the first column stretches, the others fit."""
    table = QTreeWidget()
    table.setObjectName("modelTable")
    table.setColumnCount(len(columns))
    table.setHeaderLabels(columns)
    table.setRootIsDecorated(False)
    table.setAlternatingRowColors(True)
    table.setSelectionMode(QAbstractItemView.SingleSelection)
    table.setUniformRowHeights(True)
    header = table.header()
    header.setSectionResizeMode(0, QHeaderView.Stretch)
    for i in range(1, len(columns)):
        header.setSectionResizeMode(i, QHeaderView.ResizeToContents)
    return table
