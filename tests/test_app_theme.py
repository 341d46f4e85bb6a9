"""The themes reach what Qt's palette and style sheet do not: pyqtgraph's plots and the Race
legend's swatches (offscreen Qt)."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication

from app import theme
from app.bridge import Bridge
from app.views.telemetry import TelemetryView
from app.views.token_colours import legend


def test_plots_and_the_race_legend_follow_the_theme(qtbot):
    """pyqtgraph paints its own background: the plots, their legends and axes, and the Race
    legend's swatch for the target's own tokens take the theme's colours, and change with it."""
    view, race_legend = TelemetryView(Bridge()), legend()
    qtbot.addWidget(view)
    qtbot.addWidget(race_legend)
    try:
        for name in ("dark", "light", "dark"):
            theme.apply(QGuiApplication.instance(), name)
            c = theme.PALETTES[name]
            for plot in (view.roof_plot, view.acc_plot, view.cost_plot):
                item = plot.getPlotItem()
                assert plot.backgroundBrush().color().name() == c["surface"], (name, item.titleLabel.text)
                assert item.getAxis("left").textPen().color().name() == c["text_soft"]
                assert {label.opts["color"] for _, label in item.legend.items} == {c["text"]}
            assert view.base_points.opts["pen"].color().name() == c["surface"]
            target_swatch = race_legend.swatches[2][0].styleSheet()
            assert f"background:{c['surface']};" in target_swatch and c["border_strong"] in target_swatch
    finally:
        theme.apply(QGuiApplication.instance(), "light")


def test_plain_text_set_on_a_markdown_view_survives_a_theme_change(qtbot):
    """A failed Race lane shows plain text in place of its partial Markdown: a theme change must not
    render the old Markdown back into it."""
    from app.views.markdown_view import MarkdownView

    view = MarkdownView()
    qtbot.addWidget(view)
    view.set_markdown("**partial** answer")
    view.setPlainText("")
    try:
        theme.apply(QGuiApplication.instance(), "dark")
        assert view.toPlainText() == "" and view.markdown == ""
    finally:
        theme.apply(QGuiApplication.instance(), "light")
