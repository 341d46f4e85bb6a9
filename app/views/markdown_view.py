"""A QTextBrowser that shows one message rendered by ``app.markdown_render``: Copy links on code
blocks, click-to-fold reasoning, web links opened in the browser. ``auto_height`` makes it as
tall as its text (a chat bubble inside a scrolling transcript) instead of scrolling itself."""

from __future__ import annotations

import math

from PySide6.QtCore import QUrl, Qt, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QFrame, QSizePolicy, QTextBrowser

from app import markdown_render, theme


STREAM_RENDER_MS = 60  # a streaming answer re-renders at most this often (a full render per token
# is Python work on the GUI thread, competing with decoding for the GIL)


class MarkdownView(QTextBrowser):
    copied = Signal(str)  # the text put on the clipboard

    def __init__(self, object_name: str = "messageBody", auto_height: bool = True):
        super().__init__()
        self.setObjectName(object_name)
        self.auto_height = auto_height
        self.markdown = ""
        self.expanded: set[int] = set()
        self.rendered = markdown_render.Rendered("")
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._on_anchor)
        theme.notifier().changed.connect(self._on_theme)
        if auto_height:
            self.setFrameShape(QFrame.NoFrame)
            self.setVerticalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
            self.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
            self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
            self.document().setDocumentMargin(0)
            self.setFixedHeight(self._doc_height())

    def set_markdown(self, text: str) -> None:
        self.markdown = text
        self.rerender()

    def rerender(self) -> None:
        """Render again (the text, a fold, or the theme changed)."""
        self.rendered = markdown_render.render(self.markdown, theme.markdown_palette(), expanded=self.expanded)
        QTextBrowser.setHtml(self, self.rendered.html)
        if self.auto_height:
            self._fit()

    def setHtml(self, text: str) -> None:
        """HTML from the caller replaces the Markdown: a theme change keeps it."""
        self.markdown = ""
        super().setHtml(text)

    def setPlainText(self, text: str) -> None:
        """Plain text from the caller (a failed Race lane) replaces the Markdown too."""
        self.markdown = ""
        super().setPlainText(text)

    def clear(self) -> None:
        """Cleared for other content (Race's coloured tokens): a theme change keeps that too."""
        self.markdown = ""
        super().clear()

    def _on_theme(self, name: str) -> None:
        if self.markdown:
            self.rerender()

    def toggle_thought(self, index: int) -> None:
        self.expanded ^= {index}
        self.rerender()

    def copy_code(self, index: int) -> str:
        code = self.rendered.code_blocks[index]
        self._copy(code)
        return code

    def _copy(self, text: str) -> None:
        QGuiApplication.clipboard().setText(text)
        self.copied.emit(text)

    def _on_anchor(self, url: QUrl) -> None:
        scheme, rest = url.scheme(), url.path()
        if scheme == "copy" and rest.isdigit() and int(rest) < len(self.rendered.code_blocks):
            self.copy_code(int(rest))
        elif scheme == "think" and rest.isdigit():
            self.toggle_thought(int(rest))
        elif scheme in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)

    # -- height follows the text ------------------------------------------------------------------
    def _doc_height(self) -> int:
        return math.ceil(self.document().size().height()) + 2

    def _fit(self) -> None:
        self.document().setTextWidth(self.viewport().width())
        height = self._doc_height()
        if height != self.height():
            self.setFixedHeight(height)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if self.auto_height:
            self._fit()

    def wheelEvent(self, event) -> None:
        if self.auto_height:  # nothing to scroll here: the transcript around it scrolls
            event.ignore()
            return
        super().wheelEvent(event)
