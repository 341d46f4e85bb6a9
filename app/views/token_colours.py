"""How a race lane paints its tokens: the background says who produced a token (an accepted
lookup draft, an accepted drafter-model draft, or the target's own choice), the foreground
marks the token diff against baseline. Qt formats only; the per-token sources come from the
worker (app.race_verdict.token_sources)."""

from __future__ import annotations

from typing import Sequence

from PySide6.QtGui import QColor, QTextCharFormat
from PySide6.QtWidgets import QLabel, QWidget

from app import theme
from app.views.common import BAD, hbox

# Soft tints, so long runs stay readable and the diff's red still stands out on top of them.
SOURCE_COLOURS = {"lookup": "#fde68a", "drafter": "#bfdbfe"}
SOURCE_LABELS = {"lookup": "lookup draft, accepted", "drafter": "drafter model's draft, accepted",
                 "target": "the target's own token"}
AFTER_COLOUR = "#b91c1c"
TINTED_TEXT = "#111827"  # dark text on the light tints, also in the dark theme (light text would vanish)


def token_format(source: str, diff: str = "same") -> QTextCharFormat:
    """The format of one token: background by source, then the diff state over it."""
    fmt = QTextCharFormat()
    if source in SOURCE_COLOURS:
        fmt.setBackground(QColor(SOURCE_COLOURS[source]))
        fmt.setForeground(QColor(TINTED_TEXT))
    if diff == "diverged":  # the first token that differs from baseline: unmissable
        fmt.setBackground(QColor(BAD))
        fmt.setForeground(QColor("white"))
        fmt.setFontWeight(700)
    elif diff == "after":  # past a divergence the texts no longer line up
        fmt.setForeground(QColor(AFTER_COLOUR))
        fmt.setUnderlineStyle(QTextCharFormat.UnderlineStyle.WaveUnderline)
        fmt.setUnderlineColor(QColor(AFTER_COLOUR))
    return fmt


def source_summary(sources: Sequence[str]) -> str:
    """e.g. "45% drafted (lookup 12%, drafter 33%)" or "14% drafted by lookup"; "" when nothing was."""
    n = len(sources)
    counts = {k: sum(1 for s in sources if s == k) for k in SOURCE_COLOURS}
    drafted = sum(counts.values())
    if not n or not drafted:
        return ""
    used = {k: c for k, c in counts.items() if c}
    if len(used) == 1:
        return f"{100 * drafted / n:.0f}% drafted by {next(iter(used))}"
    return f"{100 * drafted / n:.0f}% drafted ({', '.join(f'{k} {100 * c / n:.0f}%' for k, c in used.items())})"


class Legend(QWidget):
    """One row: what each token colour means. The target's own tokens sit on the theme's surface,
    so their swatch (and every swatch's border) follows the theme."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("tokenLegend")
        rows = [(SOURCE_COLOURS["lookup"], SOURCE_LABELS["lookup"]),
                (SOURCE_COLOURS["drafter"], SOURCE_LABELS["drafter"]),
                (None, SOURCE_LABELS["target"]),  # None: the theme's surface
                (BAD, "first token that differs from baseline")]
        self.swatches: list[tuple[QLabel, str | None]] = []
        items = []
        for colour, text in rows:
            box = QLabel()
            box.setFixedSize(14, 14)
            self.swatches.append((box, colour))
            item = QWidget()
            item.setLayout(hbox(box, QLabel(text), spacing=6))
            items.append(item)
        self.setLayout(hbox(*items, None, spacing=18))
        self.apply_theme()
        theme.notifier().changed.connect(self.apply_theme)

    def apply_theme(self, _name: str = "") -> None:
        c = theme.colours()
        for box, colour in self.swatches:
            box.setStyleSheet(f"background:{colour or c['surface']}; border:1px solid {c['border_strong']}; "
                              f"border-radius:3px;")

def legend() -> Legend:
    return Legend()
