"""The Chat tab's parts: a message bubble, the prompt box, the conversation list and the
parameters panel. They hold no conversation state; ``ChatView`` (app/views/chat.py) wires them."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from PySide6.QtCore import QMimeData, QTimer, Qt, Signal
from PySide6.QtGui import QGuiApplication, QKeyEvent
from PySide6.QtWidgets import (QDoubleSpinBox, QFormLayout, QFrame, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QPlainTextEdit, QPushButton, QSizePolicy, QSpinBox, QToolButton,
                               QVBoxLayout, QWidget)

from app import markdown_render
from app.conversations import Conversation
from app.settings import SAMPLING_DEFAULTS, sampling_settings
from app.views.chat_images import ThumbnailRow
from app.views.common import hbox, plain_label, set_tone, spin
from app.views.markdown_view import MarkdownView


def _action(text: str, tip: str) -> QToolButton:
    b = QToolButton()
    b.setText(text)
    b.setToolTip(tip)
    b.setObjectName("msgAction")
    b.setCursor(Qt.PointingHandCursor)
    b.setAutoRaise(True)
    return b


class MessageWidget(QFrame):
    """One message: who, the rendered text, actions (Copy; Edit on yours; Regenerate on the last
    answer) and, under an answer, its numbers. Edit swaps the text for an editor in place."""

    edit_submitted = Signal(str)
    regenerate_requested = Signal()

    def __init__(self, role: str, text: str = "", images: Sequence[bytes] = ()):
        super().__init__()
        self.role = role
        self.content = text
        self.images = list(images)
        self.setObjectName("bubbleUser" if role == "user" else "bubbleAssistant")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 8, 14, 10)
        lay.setSpacing(4)
        who = QLabel("You" if role == "user" else "Assistant")
        who.setObjectName("bubbleRole")
        self.copy_button = _action("Copy", "Copy this message (without its reasoning)")
        self.copy_button.clicked.connect(self.copy)
        self.edit_button = _action("Edit", "Edit this message and answer again from here (drops later turns)")
        self.edit_button.clicked.connect(self.start_edit)
        self.edit_button.setVisible(role == "user")
        self.regen_button = _action("Regenerate", "Answer this turn again")
        self.regen_button.clicked.connect(self.regenerate_requested)
        self.regen_button.hide()
        lay.addLayout(hbox(who, None, self.copy_button, self.edit_button, self.regen_button, spacing=2))
        self.thumbnails = ThumbnailRow(self.images) if self.images else None
        if self.thumbnails is not None:
            lay.addWidget(self.thumbnails)
        self.body = MarkdownView()
        lay.addWidget(self.body)
        self.editor = QPlainTextEdit()
        self.editor.setObjectName("prompt")
        self.editor.setMinimumHeight(80)
        self.save_edit = QPushButton("Save && answer")
        self.save_edit.setObjectName("primary")
        self.save_edit.clicked.connect(self._submit_edit)
        self.cancel_edit_button = QPushButton("Cancel")
        self.cancel_edit_button.setObjectName("secondary")
        self.cancel_edit_button.clicked.connect(self.cancel_edit)
        self.edit_row = QWidget()
        self.edit_row.setLayout(hbox(None, self.cancel_edit_button, self.save_edit))
        for w in (self.editor, self.edit_row):
            w.hide()
            lay.addWidget(w)
        self.footer = plain_label("", "bubbleFooter")
        self.footer.hide()
        lay.addWidget(self.footer)
        self.render()

    def render(self) -> None:
        self.body.set_markdown(self.content)

    def set_text(self, text: str) -> None:
        self.content = text
        self.render()

    def set_footer(self, text: str, tone: str = "") -> None:
        self.footer.setText(text)
        set_tone(self.footer, tone)
        self.footer.setVisible(bool(text))

    def set_actions_enabled(self, enabled: bool) -> None:
        self.edit_button.setEnabled(enabled)
        self.regen_button.setEnabled(enabled)

    def copy(self) -> str:
        text = markdown_render.plain_text(self.content) if self.role == "assistant" else self.content
        QGuiApplication.clipboard().setText(text)
        self.copy_button.setText("Copied")
        QTimer.singleShot(1200, self.copy_button, lambda: self.copy_button.setText("Copy"))
        return text

    def start_edit(self) -> None:
        self.editor.setPlainText(self.content)
        self.body.hide()
        self.editor.show()
        self.edit_row.show()
        self.editor.setFocus()

    def cancel_edit(self) -> None:
        self.editor.hide()
        self.edit_row.hide()
        self.body.show()

    def _submit_edit(self) -> None:
        text = self.editor.toPlainText().strip()
        if text:
            self.cancel_edit()
            self.edit_submitted.emit(text)


class ElidedLabel(QLabel):
    """One line that ends in "…" when it does not fit, instead of widening the window."""

    def __init__(self, object_name: str = ""):
        super().__init__()
        self.setObjectName(object_name)
        self.full_text = ""
        self.setTextFormat(Qt.PlainText)
        self.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.setMinimumWidth(60)

    def set_full_text(self, text: str) -> None:
        self.full_text = text
        self.setToolTip(text)
        self._elide()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        self.setText(self.fontMetrics().elidedText(self.full_text, Qt.ElideRight, max(self.width(), 20)))


class PromptEdit(QPlainTextEdit):
    """Enter sends, Shift+Enter adds a line; a pasted or dropped image goes to ``on_images``."""

    def __init__(self, on_send, on_images: Optional[Callable[[QMimeData], bool]] = None):
        super().__init__()
        self._on_send = on_send
        self._on_images = on_images

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return (self._on_images is not None and (source.hasImage() or source.hasUrls())) \
            or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        if self._on_images is not None and self._on_images(source):
            return
        super().insertFromMimeData(source)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key_Return, Qt.Key_Enter) and not event.modifiers() & Qt.ShiftModifier:
            self._on_send()
            return
        super().keyPressEvent(event)


class ConversationList(QFrame):
    """The sidebar: New chat, a search box and the conversations, newest first. Double-click
    renames in place; the context menu has rename, export and delete (ChatView builds it)."""

    open_requested = Signal(int)
    renamed = Signal(int, str)

    def __init__(self):
        super().__init__()
        self.setObjectName("sidebar")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 12, 10, 10)
        lay.setSpacing(8)
        self.new_button = QPushButton("New chat")
        self.new_button.setObjectName("primary")
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        self.list = QListWidget()
        self.list.setObjectName("conversationList")
        self.list.setContextMenuPolicy(Qt.CustomContextMenu)
        self.list.setEditTriggers(QListWidget.EditTrigger.DoubleClicked | QListWidget.EditTrigger.EditKeyPressed)
        self.list.setTextElideMode(Qt.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.list.setWordWrap(False)
        self.list.itemClicked.connect(self._on_clicked)
        self.list.itemChanged.connect(self._on_changed)
        self.empty = plain_label("", "hint")
        lay.addWidget(self.new_button)
        lay.addWidget(self.search)
        lay.addWidget(self.list, 1)
        lay.addWidget(self.empty)
        self._filling = False

    def fill(self, conversations: list[Conversation], current: Optional[int], query: str = "") -> None:
        self._filling = True
        self.list.clear()
        for conv in conversations:
            item = QListWidgetItem(conv.display_title)
            item.setData(Qt.UserRole, conv.id)
            item.setToolTip(conv.display_title)
            item.setFlags(item.flags() | Qt.ItemIsEditable)
            self.list.addItem(item)
            if conv.id == current:
                item.setSelected(True)
                self.list.setCurrentItem(item)
        self._filling = False
        self.empty.setText("" if conversations else ("no chat matches" if query else "no saved chats yet"))
        self.empty.setVisible(not conversations)

    def ids(self) -> list[int]:
        return [self.list.item(i).data(Qt.UserRole) for i in range(self.list.count())]

    def item_for(self, conversation_id: int) -> Optional[QListWidgetItem]:
        for i in range(self.list.count()):
            if self.list.item(i).data(Qt.UserRole) == conversation_id:
                return self.list.item(i)
        return None

    def _on_clicked(self, item: QListWidgetItem) -> None:
        self.open_requested.emit(item.data(Qt.UserRole))

    def _on_changed(self, item: QListWidgetItem) -> None:
        if not self._filling:
            self.renamed.emit(item.data(Qt.UserRole), item.text())


class ParametersPanel(QFrame):
    """A conversation's system prompt and sampling settings, plus saving them as the defaults
    for new chats. ``changed`` fires (debounced for typing) when the user edits anything."""

    changed = Signal()
    save_defaults = Signal()
    reset_defaults = Signal()

    def __init__(self):
        super().__init__()
        self.setObjectName("paramsPanel")
        self.setFixedWidth(290)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 12, 14, 12)
        lay.setSpacing(8)
        title = QLabel("This chat")
        title.setObjectName("cardTitle")
        lay.addWidget(title)
        lay.addWidget(plain_label("System prompt", "fieldLabel"))
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setObjectName("prompt")
        self.system_prompt.setPlaceholderText("e.g. You are a concise assistant. Answer in English.")
        self.system_prompt.setMinimumHeight(110)
        lay.addWidget(self.system_prompt, 1)
        d = SAMPLING_DEFAULTS
        self.temperature = spin(QDoubleSpinBox, 0.0, 2.0, d["temperature"], 0.1)
        self.temperature.setToolTip("0 = greedy: every mode gives the same text, only faster")
        self.top_p = spin(QDoubleSpinBox, 0.01, 1.0, d["top_p"], 0.05)
        self.top_k = spin(QSpinBox, 0, 1000, d["top_k"], 1)
        self.top_k.setToolTip("0 = off")
        self.max_tokens = spin(QSpinBox, 1, 32768, d["max_tokens"], 128)
        self.seed = spin(QSpinBox, -1, 2**31 - 1, d["seed"], 1)
        self.seed.setSpecialValueText("random")
        self.seed.setToolTip("fixes the sampled text at temperature > 0; random = a new draw each time")
        form = QFormLayout()
        form.setSpacing(6)
        form.setLabelAlignment(Qt.AlignLeft | Qt.AlignVCenter)
        for text, w in (("Temperature", self.temperature), ("Top-p", self.top_p), ("Top-k", self.top_k),
                        ("Max tokens", self.max_tokens), ("Seed", self.seed)):
            form.addRow(plain_label(text, "fieldLabel", wrap=False), w)
        lay.addLayout(form)
        self.save_button = QPushButton("Save as defaults")
        self.save_button.setObjectName("secondary")
        self.save_button.setToolTip("New chats start with these settings and mode")
        self.save_button.clicked.connect(self.save_defaults)
        self.reset_button = QPushButton("Use defaults")
        self.reset_button.setObjectName("secondary")
        self.reset_button.setToolTip("Put this chat's settings back to the saved defaults")
        self.reset_button.clicked.connect(self.reset_defaults)
        lay.addWidget(self.save_button)
        lay.addWidget(self.reset_button)
        self.note = plain_label("", "hint")
        lay.addWidget(self.note)

        self._loading = False
        self._typing = QTimer(self)
        self._typing.setSingleShot(True)
        self._typing.setInterval(400)
        self._typing.timeout.connect(self.changed)
        self.system_prompt.textChanged.connect(self._on_typing)
        for w in (self.temperature, self.top_p, self.top_k, self.max_tokens, self.seed):
            w.valueChanged.connect(self._on_value)

    def _on_typing(self) -> None:
        if not self._loading:
            self._typing.start()

    def _on_value(self, *_) -> None:
        if not self._loading:
            self.changed.emit()

    def flush(self) -> None:
        """Emit a pending (debounced) change now."""
        if self._typing.isActive():
            self._typing.stop()
            self.changed.emit()

    def show_conversation(self, conv: Conversation) -> None:
        self._typing.stop()
        self._loading = True
        try:
            s = sampling_settings(conv.settings)
            if self.system_prompt.toPlainText() != conv.system_prompt:
                self.system_prompt.setPlainText(conv.system_prompt)
            self.temperature.setValue(s["temperature"])
            self.top_p.setValue(s["top_p"])
            self.top_k.setValue(s["top_k"])
            self.max_tokens.setValue(s["max_tokens"])
            self.seed.setValue(s["seed"])
        finally:
            self._loading = False

    def values(self) -> dict:
        return {"temperature": self.temperature.value(), "top_p": self.top_p.value(), "top_k": self.top_k.value(),
                "max_tokens": self.max_tokens.value(), "seed": self.seed.value()}

