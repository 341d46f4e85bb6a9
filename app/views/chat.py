"""Chat tab: a multi-turn conversation streamed from the engine worker."""

from __future__ import annotations

from typing import Optional

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QProgressBar,
                               QPushButton, QScrollArea, QSpinBox, QVBoxLayout, QWidget)

from app.bridge import Bridge
from app.views.common import MODE_HELP, MODES, hbox, plain_label, set_tone, spin, turn_stats

WELCOME = ("Ask anything. Replies stream from the local model. Pick a decoding mode above: at temperature 0 "
           "every mode gives the same text, only faster.")


class Bubble(QFrame):
    """One turn: the text, and (assistant) a stats footer."""

    def __init__(self, role: str, text: str = ""):
        super().__init__()
        self.role = role
        self.setObjectName("bubbleUser" if role == "user" else "bubbleAssistant")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 10, 14, 10)
        lay.setSpacing(4)
        who = QLabel("You" if role == "user" else "Assistant")
        who.setObjectName("bubbleRole")
        lay.addWidget(who)
        self.text = plain_label(text, "bubbleText")
        self.text.setTextInteractionFlags(Qt.TextSelectableByMouse)
        lay.addWidget(self.text)
        self.footer = plain_label("", "bubbleFooter")
        self.footer.hide()
        lay.addWidget(self.footer)
        self.content = text

    def append(self, text: str) -> None:
        self.content += text
        self.text.setText(self.content)

    def set_footer(self, text: str, tone: str = "") -> None:
        self.footer.setText(text)
        set_tone(self.footer, tone)
        self.footer.show()


class PromptEdit(QPlainTextEdit):
    """Enter sends, Shift+Enter adds a line."""

    def __init__(self, on_send):
        super().__init__()
        self._on_send = on_send

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key_Return, Qt.Key_Enter) and not event.modifiers() & Qt.ShiftModifier:
            self._on_send()
            return
        super().keyPressEvent(event)


class ChatView(QWidget):
    def __init__(self, bridge: Bridge, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.bridge = bridge
        self.messages: list[dict] = []
        self.request_id: Optional[int] = None
        self.current: Optional[Bubble] = None
        self.model_ready = False
        self.last_result: Optional[dict] = None

        root = QVBoxLayout(self)
        root.setContentsMargins(20, 16, 20, 16)
        root.setSpacing(12)

        # settings row
        self.mode = QComboBox()
        self.mode.addItems(MODES)
        for i, m in enumerate(MODES):
            self.mode.setItemData(i, MODE_HELP[m], Qt.ToolTipRole)
        self.temperature = spin(QDoubleSpinBox, 0.0, 2.0, 0.0, 0.1)
        self.temperature.setToolTip("0 = greedy (lossless: identical text in every mode)")
        self.top_p = spin(QDoubleSpinBox, 0.01, 1.0, 1.0, 0.05)
        self.top_k = spin(QSpinBox, 0, 1000, 0, 1)
        self.top_k.setToolTip("0 = off")
        self.max_tokens = spin(QSpinBox, 1, 8192, 256, 64)
        self.new_chat = QPushButton("New chat")
        self.new_chat.setObjectName("secondary")
        self.new_chat.clicked.connect(self.clear)
        row = QHBoxLayout()
        row.setSpacing(6)
        for text, w in (("Mode", self.mode), ("Temperature", self.temperature), ("Top-p", self.top_p),
                        ("Top-k", self.top_k), ("Max tokens", self.max_tokens)):
            lab = QLabel(text)
            lab.setObjectName("fieldLabel")
            row.addWidget(lab)
            row.addWidget(w)
            row.addSpacing(10)
        row.addStretch(1)
        row.addWidget(self.new_chat)
        root.addLayout(row)

        # loading banner
        self.banner = QFrame()
        self.banner.setObjectName("banner")
        self.banner_text = plain_label("Loading the starter model…", "bannerText")
        self.banner_bar = QProgressBar()
        self.banner_bar.setRange(0, 0)
        self.banner_bar.setFixedWidth(160)
        self.banner_bar.setTextVisible(False)
        self.banner.setLayout(hbox(self.banner_text, None, self.banner_bar, margins=(14, 8, 14, 8)))
        root.addWidget(self.banner)

        # transcript
        self.scroll = QScrollArea()
        self.scroll.setObjectName("transcript")
        self.scroll.setWidgetResizable(True)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        holder = QWidget()
        holder.setObjectName("transcriptInner")
        self.column = QVBoxLayout(holder)
        self.column.setContentsMargins(8, 8, 8, 8)
        self.column.setSpacing(10)
        self.welcome = plain_label(WELCOME, "welcome")
        self.welcome.setAlignment(Qt.AlignCenter)
        self.column.addWidget(self.welcome)
        self.column.addStretch(1)
        self.scroll.setWidget(holder)
        root.addWidget(self.scroll, 1)

        # input row
        self.input = PromptEdit(self.send)
        self.input.setObjectName("prompt")
        self.input.setPlaceholderText("Message the model  (Enter to send, Shift+Enter for a new line)")
        self.input.setFixedHeight(72)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.setFixedHeight(40)
        self.send_button.clicked.connect(self._send_or_stop)
        self.status = plain_label("", "hint")
        root.addLayout(hbox(self.input, self.send_button, spacing=10))
        root.addWidget(self.status)

        b = bridge
        b.model_loading.connect(self._on_loading)
        b.model_loaded.connect(self._on_loaded)
        b.model_failed.connect(self._on_load_failed)
        b.gen_started.connect(self._on_started)
        b.gen_text.connect(self._on_text)
        b.gen_finished.connect(self._on_finished)
        b.gen_failed.connect(self._on_failed)
        self._update_button()

    # -- state ---------------------------------------------------------------------------------
    @property
    def generating(self) -> bool:
        return self.request_id is not None

    def params(self) -> dict:
        return {"mode": self.mode.currentText(), "temperature": self.temperature.value(), "top_p": self.top_p.value(),
                "top_k": self.top_k.value(), "max_new_tokens": self.max_tokens.value()}

    def _update_button(self) -> None:
        self.send_button.setText("Stop" if self.generating else "Send")
        self.send_button.setObjectName("danger" if self.generating else "primary")
        self.send_button.style().unpolish(self.send_button)
        self.send_button.style().polish(self.send_button)
        self.send_button.setEnabled(self.generating or self.model_ready)

    # -- actions -------------------------------------------------------------------------------
    def _send_or_stop(self) -> None:
        if self.generating:
            self.stop()
        else:
            self.send()

    def send(self, text: Optional[str] = None) -> Optional[int]:
        text = (text if text is not None else self.input.toPlainText()).strip()
        if not text or self.generating:
            return None
        self.input.clear()
        self.welcome.hide()
        self.messages.append({"role": "user", "content": text})
        self._add_bubble(Bubble("user", text))
        self.current = Bubble("assistant")
        self.current.set_footer("waiting for the model…" if not self.model_ready else "thinking…", "muted")
        self._add_bubble(self.current)
        self.request_id = self.bridge.generate([dict(m) for m in self.messages], self.params())
        self.status.setText("")
        self._update_button()
        return self.request_id

    def stop(self) -> None:
        if self.request_id is not None:
            self.bridge.cancel(self.request_id)
            self.status.setText("stopping after this round…")

    def clear(self) -> None:
        self.stop()
        self.request_id = None
        self.messages.clear()
        self.current = None
        while self.column.count() > 2:  # keep the welcome label and the stretch
            item = self.column.takeAt(1)
            if item.widget():
                item.widget().deleteLater()
        self.welcome.show()
        self._update_button()

    def _add_bubble(self, bubble: Bubble) -> None:
        self.column.insertWidget(self.column.count() - 1, bubble)
        QTimer.singleShot(0, self._scroll_to_end)

    def _scroll_to_end(self) -> None:
        bar = self.scroll.verticalScrollBar()
        bar.setValue(bar.maximum())

    # -- worker replies ----------------------------------------------------------------------------
    def _on_loading(self, what: str) -> None:
        self.model_ready = False
        self.banner_text.setText(f"Loading {what}…  (first start converts the model once; later starts are quick)")
        self.banner_bar.show()
        set_tone(self.banner_text, "")
        self.banner.show()
        self._update_button()

    def _on_loaded(self, info: dict) -> None:
        self.model_ready = True
        self.banner.hide()
        self._update_button()
        self.input.setFocus()

    def _on_load_failed(self, message: str) -> None:
        self.model_ready = self.bridge.model_info != {}
        self.banner_text.setText(message)
        set_tone(self.banner_text, "bad")
        self.banner_bar.hide()
        self.banner.show()
        self._update_button()

    def _on_started(self, rid: int, info: dict) -> None:
        if rid == self.request_id and self.current is not None:
            self.current.set_footer(f"generating · mode {info.get('mode')} · prompt {info.get('prompt_tokens')} tokens",
                                    "muted")

    def _on_text(self, rid: int, text: str) -> None:
        if rid == self.request_id and self.current is not None:
            self.current.append(text)
            QTimer.singleShot(0, self._scroll_to_end)

    def _on_finished(self, rid: int, result: dict) -> None:
        if rid != self.request_id:
            return
        self.last_result = result
        if self.current is not None:
            if self.current.content != result["text"]:  # the final text is authoritative (stop strings)
                self.current.content = ""
                self.current.append(result["text"])
            self.current.set_footer(turn_stats(result), "muted")
        if result["text"]:
            self.messages.append({"role": "assistant", "content": result["text"]})
        self.status.setText("stopped" if result.get("finish_reason") == "cancelled" else "")
        self._done()

    def _on_failed(self, rid: int, message: str) -> None:
        if rid != self.request_id:
            return
        if self.current is not None:
            self.current.set_footer(message, "bad")
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()  # the failed turn does not become part of the conversation
        self.status.setText("")
        self._done()

    def _done(self) -> None:
        self.request_id = None
        self.current = None
        self._update_button()
        QTimer.singleShot(0, self._scroll_to_end)
