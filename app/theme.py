"""Light and dark themes: the palette that fills style.qss's @tokens@, Fusion's QPalette (menus,
scroll bars, dialogs) and the colours of rendered Markdown. "system" follows the OS colour scheme
(Qt 6.5+ ``styleHints().colorScheme()``) and switches when it changes."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QFont, QGuiApplication, QPalette

from app import markdown_render

THEMES = ("system", "light", "dark")
STYLE = Path(__file__).with_name("style.qss")
ICONS = Path(__file__).with_name("icons")
MIN_FONT_PT = 7.0
MAX_FONT_PT = 24.0

LIGHT = {
    "window": "#f5f6f8", "surface": "#ffffff", "surface_alt": "#f9fafb", "hover": "#f3f4f6",
    "text": "#1f2937", "text_strong": "#111827", "text_soft": "#374151", "muted": "#6b7280", "faint": "#9ca3af",
    "border": "#e5e7eb", "border_strong": "#d1d5db",
    "accent": "#3563e9", "accent_hover": "#2f59d3", "accent_soft": "#a9bcf5", "accent_bg": "#e8eefc",
    "accent_border": "#d3defb", "banner_bg": "#eef2ff", "banner_border": "#c7d2fe",
    "danger": "#dc2626", "danger_border": "#fca5a5", "danger_hover": "#fef2f2", "danger_disabled": "#fde2e2",
    "good": "#1f9d55", "warn": "#d97706", "tooltip_bg": "#111827", "tooltip_text": "#f9fafb", "status_text": "#4b5563",
}
DARK = {
    "window": "#15171c", "surface": "#1e2127", "surface_alt": "#252930", "hover": "#2b3038",
    "text": "#e5e7eb", "text_strong": "#f3f4f6", "text_soft": "#d1d5db", "muted": "#9ca3af", "faint": "#7b8494",
    "border": "#30343c", "border_strong": "#424853",
    "accent": "#4c74e8", "accent_hover": "#3f66d9", "accent_soft": "#34477a", "accent_bg": "#223055",
    "accent_border": "#2f4170", "banner_bg": "#1d2440", "banner_border": "#2f3c6b",
    "danger": "#f87171", "danger_border": "#7f2d2d", "danger_hover": "#2a1c1c", "danger_disabled": "#3b2727",
    "good": "#34d399", "warn": "#fbbf24", "tooltip_bg": "#f3f4f6", "tooltip_text": "#111827", "status_text": "#aab1bd",
}
PALETTES = {"light": LIGHT, "dark": DARK}

_current = {"name": "light", "size": 0.0}


class _Notifier(QObject):
    changed = Signal(str)  # "light" or "dark" (after a theme or text size change): Markdown re-renders


_notifier: list[_Notifier] = []


def notifier() -> _Notifier:
    if not _notifier:
        _notifier.append(_Notifier())
    return _notifier[0]

_base_font: list[float] = []  # the platform's default size, read once


def resolve(choice: str) -> str:
    """"light" or "dark" for a theme choice; "system" asks the OS (unknown: light)."""
    if choice in PALETTES:
        return choice
    hints = QGuiApplication.styleHints() if QGuiApplication.instance() is not None else None
    scheme = hints.colorScheme() if hints is not None and hasattr(hints, "colorScheme") else None
    return "dark" if scheme == Qt.ColorScheme.Dark else "light"


def current() -> str:
    return _current["name"]


def colours() -> dict:
    return PALETTES[_current["name"]]


def markdown_palette() -> dict:
    return markdown_render.DARK if _current["name"] == "dark" else markdown_render.LIGHT


def default_font_pt() -> float:
    return _base_font[0] if _base_font else 10.0


def stylesheet(name: str, font_pt: float) -> str:
    tokens = dict(PALETTES[name], ICONS=ICONS.as_posix(), fs_small=f"{font_pt - 1:g}pt", fs_body=f"{font_pt + 1:g}pt",
                  fs_lane=f"{font_pt + 0.5:g}pt", fs_title=f"{font_pt + 7:g}pt", fs_title_small=f"{font_pt + 3:g}pt",
                  fs_stat=f"{font_pt + 8:g}pt")
    text = STYLE.read_text()
    for key, value in tokens.items():
        text = text.replace(f"@{key}@", value)
    return text


def qpalette(name: str) -> QPalette:
    c = PALETTES[name]
    pal = QPalette()
    roles = {
        QPalette.Window: c["window"], QPalette.WindowText: c["text"], QPalette.Base: c["surface"],
        QPalette.AlternateBase: c["surface_alt"], QPalette.Text: c["text"], QPalette.Button: c["surface"],
        QPalette.ButtonText: c["text"], QPalette.Highlight: c["accent"], QPalette.HighlightedText: "#ffffff",
        QPalette.ToolTipBase: c["tooltip_bg"], QPalette.ToolTipText: c["tooltip_text"], QPalette.Link: c["accent"],
        QPalette.PlaceholderText: c["faint"], QPalette.Mid: c["border_strong"], QPalette.Midlight: c["border"],
        QPalette.Dark: c["border_strong"], QPalette.Light: c["surface_alt"], QPalette.BrightText: c["danger"],
    }
    for role, colour in roles.items():
        pal.setColor(role, QColor(colour))
    for role in (QPalette.WindowText, QPalette.Text, QPalette.ButtonText):
        pal.setColor(QPalette.Disabled, role, QColor(c["faint"]))
    return pal


def apply(app, choice: str = "system", font_pt: Optional[float] = None) -> str:
    """Set the application's palette, style sheet and font size; returns "light" or "dark".
    ``font_pt`` None or 0: the platform's size (at least 10 pt)."""
    if not _base_font:
        _base_font.append(max(app.font().pointSizeF(), 10.0))
    size = min(max(float(font_pt), MIN_FONT_PT), MAX_FONT_PT) if font_pt else default_font_pt()
    name = resolve(choice)
    changed = (name, size) != (_current["name"], _current["size"])
    _current.update(name=name, size=size)
    font = QFont(app.font())
    font.setPointSizeF(size)
    app.setFont(font)
    app.setPalette(qpalette(name))
    if STYLE.exists():
        app.setStyleSheet(stylesheet(name, size))
    if changed:
        notifier().changed.emit(name)
    return name
