"""Chat tab: saved conversations (sidebar), a transcript rendered as Markdown while it streams, and
per-chat system prompt, sampling and mode; regenerate, edit-and-continue, stop; a model switch.

The whole history goes to the worker as chat messages on every turn (the engine's prefix cache
reuses what it has seen). A turn is written to the history file only when its answer ends, in
one transaction that also drops any turns an edit or a regenerate replaces (app/conversations.py).
Images attach to the message being written (the Image… button, paste, drag and drop;
app/views/chat_images.py), show as thumbnails in the transcript and are stored with the
conversation; a model that takes no images says so before anything is sent.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from PySide6.QtCore import QPoint, Qt, QTimer
from PySide6.QtWidgets import (QFileDialog, QFrame, QHBoxLayout, QMenu, QMessageBox, QProgressBar, QPushButton,
                               QScrollArea, QVBoxLayout, QWidget)

from app import conversations as history
from app.bridge import Bridge
from app.conversations import Conversation, ConversationStore, Message, chat_message
from app.settings import AppSettings, history_path, sampling_settings
from app.views.chat_header import ChatHeader
from app.views.chat_images import FILE_FILTER, AttachmentStrip, attach_from, load_image
from app.views.chat_widgets import ConversationList, MessageWidget, ParametersPanel, PromptEdit
from app.views.common import hbox, plain_label, set_tone, turn_stats
from app.views.markdown_view import STREAM_RENDER_MS
from engine.errors import TandemError
from engine.images import ImageError

WELCOME = ("Ask anything. Replies stream from the local model. Pick a decoding mode above: at temperature 0 "
           "every mode gives the same text, only faster.")
FOLLOW_SLACK = 40  # px from the bottom that still counts as "at the bottom"
STAT_KEYS = ("tokens", "prompt_tokens", "cached_tokens", "decode_tps", "ttft_s", "mean_accepted", "mode", "cap",
             "finish_reason", "model", "temperature")


@dataclass
class Turn:
    """The answer in flight: which conversation it belongs to and where its user message goes."""

    rid: int
    conv: Conversation
    position: int
    user: Message
    bubble: MessageWidget
    text: str = ""


class ChatView(QWidget):
    def __init__(self, bridge: Bridge, settings: Optional[AppSettings] = None,
                 store: Optional[ConversationStore] = None, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.bridge = bridge
        self.settings = settings or AppSettings()
        self.history_error = ""
        self.store = store or self._open_store()
        self.conv = self._new_conversation()
        self.bubbles: list[MessageWidget] = []
        self.turn: Optional[Turn] = None
        self.model_ready = False
        self.last_result: Optional[dict] = None
        self._deleted: set[int] = set()
        self._follow = True
        # Asked before deleting / for an export path; tests replace them (dialogs would block).
        self.confirm: Callable[[str, str], bool] = self._ask
        self.ask_save_path: Callable[[str, str, str], Optional[str]] = self._ask_path
        self.ask_image_paths: Callable[[], list[str]] = self._ask_images

        outer = QHBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(0)
        self.sidebar = ConversationList()
        self.sidebar.setFixedWidth(250)
        self.sidebar.new_button.clicked.connect(self.new_chat)
        self.sidebar.search.textChanged.connect(lambda _: self.refresh_list())
        self.sidebar.open_requested.connect(self.open_conversation)
        self.sidebar.renamed.connect(self.rename_conversation)
        self.sidebar.list.customContextMenuRequested.connect(self._list_menu)
        outer.addWidget(self.sidebar)

        main = QWidget()
        root = QVBoxLayout(main)
        root.setContentsMargins(20, 12, 20, 14)
        root.setSpacing(10)
        outer.addWidget(main, 1)
        self.panel = ParametersPanel()
        self.panel.changed.connect(self._on_params_changed)
        self.panel.save_defaults.connect(self.save_defaults)
        self.panel.reset_defaults.connect(self.reset_to_defaults)
        self.panel.setVisible(self.settings.show_parameters)
        outer.addWidget(self.panel)
        # the panel's fields, by their old names (tests and scripts set them directly)
        self.temperature, self.top_p, self.top_k = self.panel.temperature, self.panel.top_p, self.panel.top_k
        self.max_tokens, self.seed = self.panel.max_tokens, self.panel.seed
        self.system_prompt = self.panel.system_prompt

        self.header = ChatHeader(bridge)
        self.title, self.mode, self.params_button = self.header.title, self.header.mode, self.header.params_button
        self.mode.currentTextChanged.connect(self._on_mode_changed)
        self.think = self.header.think
        self.think.toggled.connect(self._on_think_changed)
        self.params_button.setChecked(self.settings.show_parameters)
        self.params_button.toggled.connect(self.show_parameters)
        self.header.notice.connect(lambda text: self._say(text, "warn"))
        root.addWidget(self.header)

        # banner: loading / failed load
        self.banner = QFrame()
        self.banner.setObjectName("banner")
        self.banner_text = plain_label("Loading the starter model…", "bannerText")
        self.banner_bar = QProgressBar()
        self.banner_bar.setRange(0, 0)
        self.banner_bar.setFixedWidth(160)
        self.banner_bar.setTextVisible(False)
        self.banner.setLayout(hbox((self.banner_text, 1), self.banner_bar, margins=(14, 8, 14, 8)))
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
        bar = self.scroll.verticalScrollBar()
        bar.valueChanged.connect(self._on_scrolled)
        bar.rangeChanged.connect(self._on_range)
        root.addWidget(self.scroll, 1)

        # input
        self.input = PromptEdit(self.send, on_images=self._attach_mime)
        self.input.setObjectName("prompt")
        self.input.setPlaceholderText("Message the model  (Enter to send, Shift+Enter for a new line)")
        self.input.setFixedHeight(72)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.setFixedHeight(40)
        self.send_button.clicked.connect(self._send_or_stop)
        self.attach_button = QPushButton("Image…")
        self.attach_button.setObjectName("secondary")
        self.attach_button.setFixedHeight(40)
        self.attach_button.setToolTip("Attach images to this message (or paste them, or drop them here)")
        self.attach_button.clicked.connect(self.pick_images)
        self.attachments = AttachmentStrip()
        self.setAcceptDrops(True)
        self.status = plain_label("", "hint")
        root.addWidget(self.attachments)
        root.addLayout(hbox(self.input, self.attach_button, self.send_button, spacing=10))
        root.addWidget(self.status)

        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.setInterval(STREAM_RENDER_MS)
        self._render_timer.timeout.connect(self._render_stream)

        b = bridge
        b.model_loading.connect(self._on_loading)
        b.model_loaded.connect(self._on_loaded)
        b.model_failed.connect(self._on_load_failed)
        b.gen_started.connect(self._on_started)
        b.gen_calibrating.connect(self._on_calibrating)
        b.gen_text.connect(self._on_text)
        b.gen_finished.connect(self._on_finished)
        b.gen_failed.connect(self._on_failed)

        last = self.settings.last_conversation
        restored = self.store.load(last) if last is not None else None
        self._show(restored or self.conv)
        self.refresh_list()
        self._update_button()
        if self.history_error:
            self._say(self.history_error, "warn")

    # -- the history file ------------------------------------------------------------------------
    def _open_store(self) -> ConversationStore:
        """The history file, or (unreadable) an in-memory store and a note: the chat still works."""
        path = history_path()
        try:
            return ConversationStore(path)
        except TandemError as err:
            self.history_error = f"{err}; chats are kept only until you quit"
            return ConversationStore(":memory:")

    def _say(self, text: str, tone: str = "muted") -> None:
        self.status.setText(text)
        set_tone(self.status, tone)

    def _store_failed(self, err: Exception) -> None:
        self.history_error = f"could not save to the chat history: {err}"
        self._say(self.history_error, "bad")

    def _new_conversation(self) -> Conversation:
        return Conversation(None, settings=self.settings.sampling_defaults())

    # -- state -----------------------------------------------------------------------------------
    @property
    def generating(self) -> bool:
        return self.turn is not None

    @property
    def request_id(self) -> Optional[int]:
        return self.turn.rid if self.turn else None

    @property
    def messages(self) -> list[dict]:
        """The shown conversation's turns as chat messages (no system prompt)."""
        return [{"role": m.role, "content": m.content} for m in self.conv.messages]

    def params(self) -> dict:
        s = sampling_settings(self.conv.settings)
        return {"mode": s["mode"], "temperature": s["temperature"], "top_p": s["top_p"], "top_k": s["top_k"],
                "max_new_tokens": s["max_tokens"], "seed": None if s["seed"] < 0 else s["seed"],
                "thinking": s["thinking"]}

    def _can_send(self) -> bool:
        # while another model loads, a message waits in the worker's queue and the current one stays usable
        return self.model_ready or bool(self.bridge.model_info)

    def _update_button(self) -> None:
        self.send_button.setText("Stop" if self.generating else "Send")
        self.send_button.setObjectName("danger" if self.generating else "primary")
        self.send_button.style().unpolish(self.send_button)
        self.send_button.style().polish(self.send_button)
        self.send_button.setEnabled(self.generating or self._can_send())
        self._update_actions()

    def _update_actions(self) -> None:
        last = len(self.bubbles) - 1
        for i, bubble in enumerate(self.bubbles):
            bubble.regen_button.setVisible(i == last and bubble.role == "assistant" and not self.generating)
            bubble.set_actions_enabled(not self.generating)

    # -- sending, regenerating, editing ---------------------------------------------------------
    def _send_or_stop(self) -> None:
        if self.generating:
            self.stop()
        else:
            self.send()

    def send(self, text: Optional[str] = None) -> Optional[int]:
        text = (text if text is not None else self.input.toPlainText()).strip()
        images = list(self.attachments.images)
        if not (text or images) or self.generating:
            return None
        rid = self._ask_model(len(self.conv.messages), text, images)
        if rid is not None:
            self.input.clear()
            self.attachments.take()
        return rid

    def regenerate(self) -> Optional[int]:
        """Answer the last user message again (its old answer is replaced when the new one ends)."""
        users = [i for i, m in enumerate(self.conv.messages) if m.role == "user"]
        if self.generating or not users:
            return None
        asked = self.conv.messages[users[-1]]
        return self._ask_model(users[-1], asked.content, asked.images)

    def edit_message(self, index: int, text: str) -> Optional[int]:
        """Replace user message ``index`` and answer from there (later turns go when the answer ends)."""
        text = text.strip()
        if self.generating or not text or not (0 <= index < len(self.conv.messages)) \
                or self.conv.messages[index].role != "user":
            return None
        return self._ask_model(index, text, self.conv.messages[index].images)

    def _ask_model(self, position: int, text: str, images: Optional[list[bytes]] = None) -> Optional[int]:
        """Send the history up to ``position`` and this user message; None (and a line in the
        status bar) when the model cannot take the message's or the history's images."""
        self.panel.flush()  # a system prompt being typed goes with this message
        user = Message("user", text, images=list(images or []))
        try:
            if user.images or self.conv.has_images(position):
                self._check_images()
            prompt = self.conv.chat_messages(position) + [chat_message(user)]
        except ImageError as err:
            self._say(str(err), "bad")
            return None
        self._drop_bubbles_from(position)
        self.welcome.hide()
        self._add_bubble(MessageWidget("user", text, user.images))
        bubble = MessageWidget("assistant")
        bubble.set_footer("waiting for the model…" if not self.model_ready else "thinking…", "muted")
        self._add_bubble(bubble)
        self._follow = True
        rid = self.bridge.generate(prompt, self.params())
        self.turn = Turn(rid, self.conv, position, user, bubble)
        self._say("", "")
        self._update_button()
        QTimer.singleShot(0, self._scroll_to_end)
        return rid

    # -- images --------------------------------------------------------------------------------------
    @property
    def takes_images(self) -> bool:
        return bool(self.bridge.model_info.get("takes_images"))

    def _check_images(self) -> None:
        """Refuse images before anything is sent when the loaded model takes none (before the first
        load, the worker decides)."""
        if self.bridge.model_info and not self.takes_images:
            info = self.bridge.model_info
            why = info.get("images_note") or f"{info.get('name') or 'this model'} takes no images"
            raise ImageError(f"{why}: load a vision model (Models tab) to ask about images")

    def attach_image(self, source: bytes | Path, label: str = "image") -> bool:
        """Attach an image (its bytes, or a file) to the message being written; False (and the
        reason in the status bar) when it cannot be used."""
        try:
            self.attachments.add(load_image(source, label))
        except ImageError as err:
            self._say(str(err), "bad")
            return False
        try:
            self._check_images()
            self._say("", "")
        except ImageError as err:  # said now, before the user writes the question
            self._say(str(err), "warn")
        return True

    def pick_images(self) -> None:
        for path in self.ask_image_paths():
            self.attach_image(Path(path), path)

    def _ask_images(self) -> list[str]:
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach images", str(Path.home()), FILE_FILTER)
        return paths

    def _attach_mime(self, mime) -> bool:
        return attach_from(mime, lambda source, label: self.attach_image(source, label))

    def dragEnterEvent(self, event) -> None:
        if event.mimeData().hasImage() or event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        if self._attach_mime(event.mimeData()):
            event.acceptProposedAction()

    def stop(self) -> None:
        if self.turn is not None:
            self.bridge.cancel(self.turn.rid)
            self._say("stopping after this round…", "")

    # -- conversations ---------------------------------------------------------------------------
    def new_chat(self) -> None:
        self.stop()  # an answer in flight still lands in its own chat
        self._show(self._new_conversation())
        self.bridge.clear_prefix_cache()
        self.refresh_list()
        self.focus_prompt()

    def open_conversation(self, conversation_id: int) -> bool:
        if self.conv.id == conversation_id:
            return True
        streaming = self.turn.conv if self.turn is not None and self.turn.conv.id == conversation_id else None
        conv = streaming or self.store.load(conversation_id)
        if conv is None:
            self.refresh_list()
            return False
        self.stop()
        self._show(conv)
        self.refresh_list()
        return True

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            self.refresh_list()
            return
        try:
            self.store.rename(conversation_id, title)
        except sqlite3.Error as err:
            self._store_failed(err)
        if self.conv.id == conversation_id:
            self.conv.title = title
            self._show_title()
        self.refresh_list()

    def delete_conversation(self, conversation_id: int) -> bool:
        conv = self.store.load(conversation_id)
        if conv is None or not self.confirm("Delete chat", f"Delete “{conv.display_title}” and its "
                                                           f"{len(conv.messages)} messages? This cannot be undone."):
            return False
        if self.turn is not None and self.turn.conv.id == conversation_id:
            self.stop()
        self._deleted.add(conversation_id)
        try:
            self.store.delete(conversation_id)
        except sqlite3.Error as err:
            self._store_failed(err)
            return False
        self.bridge.clear_prefix_cache()
        if self.conv.id == conversation_id:
            rest = self.store.list()
            self._show(self.store.load(rest[0].id) if rest else self._new_conversation())
        self.refresh_list()
        return True

    def export_conversation(self, conversation_id: Optional[int] = None, path: Optional[str] = None,
                            fmt: str = "markdown") -> Optional[Path]:
        """Write a chat (the shown one by default) as Markdown or JSON; asks for a path if none."""
        conv = self.conv if conversation_id in (None, self.conv.id) else self.store.load(conversation_id)
        if conv is None:
            return None
        ext = "json" if fmt == "json" else "md"
        if path is None:
            stem = "".join(c if c.isalnum() or c in " -_" else "_" for c in conv.display_title).strip() or "chat"
            path = self.ask_save_path(f"Export chat as {'JSON' if ext == 'json' else 'Markdown'}", f"{stem}.{ext}",
                                      "JSON (*.json)" if ext == "json" else "Markdown (*.md)")
            if not path:
                return None
        text = history.to_json(conv) if ext == "json" else history.to_markdown(conv)
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as err:
            self._say(f"could not export to {path}: {err.strerror or err}", "bad")
            return None
        self._say(f"exported to {path}", "muted")
        return Path(path)

    def refresh_list(self) -> None:
        query = self.sidebar.search.text()
        self.sidebar.fill(self.store.list(query), self.conv.id, query)

    def _list_menu(self, pos: QPoint) -> None:
        item = self.sidebar.list.itemAt(pos)
        if item is None:
            return
        cid = item.data(Qt.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename", lambda: self.sidebar.list.editItem(item))
        menu.addAction("Export as Markdown…", lambda: self.export_conversation(cid, fmt="markdown"))
        menu.addAction("Export as JSON…", lambda: self.export_conversation(cid, fmt="json"))
        menu.addSeparator()
        menu.addAction("Delete…", lambda: self.delete_conversation(cid))
        menu.exec(self.sidebar.list.mapToGlobal(pos))

    def _show(self, conv: Conversation) -> None:
        self.panel.flush()  # a system prompt being typed belongs to the chat shown until now
        self.conv = conv
        self._drop_bubbles_from(0)
        for m in conv.messages:
            bubble = MessageWidget(m.role, m.content, m.images)
            if m.role == "assistant" and m.stats:
                bubble.set_footer(turn_stats(m.stats), "muted")
            self._add_bubble(bubble)
        if self.turn is not None and self.turn.conv is conv:  # back to the chat whose answer is streaming
            self._drop_bubbles_from(self.turn.position)
            self._add_bubble(MessageWidget("user", self.turn.user.content, self.turn.user.images))
            self.turn.bubble = MessageWidget("assistant", self.turn.text)
            self._add_bubble(self.turn.bubble)
        self.welcome.setVisible(not self.bubbles)
        self.panel.show_conversation(conv)
        chosen = sampling_settings(conv.settings)
        mode = chosen["mode"]
        self.mode.blockSignals(True)
        self.mode.setCurrentText(mode if self.mode.findText(mode) >= 0 else "auto")
        self.mode.blockSignals(False)
        self.think.blockSignals(True)
        self.think.setChecked(chosen["thinking"])
        self.think.blockSignals(False)
        self._show_title()
        if conv.id is not None:
            self.settings.last_conversation = conv.id
        self._follow = True
        self._update_actions()
        QTimer.singleShot(0, self._scroll_to_end)

    def _show_title(self) -> None:
        self.title.set_full_text(self.conv.display_title)

    # -- per-chat settings -------------------------------------------------------------------------
    def _on_params_changed(self) -> None:
        self.conv.settings = dict(sampling_settings(self.conv.settings), **self.panel.values())
        self.conv.system_prompt = self.panel.system_prompt.toPlainText()
        self._save_settings()

    def _on_mode_changed(self, mode: str) -> None:
        self.conv.settings = dict(sampling_settings(self.conv.settings), mode=mode)
        self._save_settings()

    def _on_think_changed(self, on: bool) -> None:
        self.conv.settings = dict(sampling_settings(self.conv.settings), thinking=on)
        self._save_settings()

    def _save_settings(self) -> None:
        if self.conv.id is not None:
            try:
                self.store.update(self.conv.id, system_prompt=self.conv.system_prompt, settings=self.conv.settings)
            except sqlite3.Error as err:
                self._store_failed(err)

    def save_defaults(self) -> None:
        self.panel.flush()
        self.settings.set_sampling_defaults(self.conv.settings)
        self.panel.note.setText("new chats will start with these settings")

    def reset_to_defaults(self) -> None:
        self.panel.flush()
        self.conv.settings = self.settings.sampling_defaults()
        self._save_settings()
        self._show(self.conv)
        self.panel.note.setText("back to the saved defaults")

    def show_parameters(self, visible: bool) -> None:
        self.panel.setVisible(visible)
        self.params_button.setChecked(visible)
        self.settings.show_parameters = visible

    def focus_prompt(self) -> None:
        self.input.setFocus()

    # -- transcript ----------------------------------------------------------------------------------
    def _add_bubble(self, bubble: MessageWidget) -> None:
        self.bubbles.append(bubble)
        self.column.insertWidget(self.column.count() - 1, bubble)
        bubble.body.copied.connect(lambda text: self._say(f"copied {len(text.splitlines())} line(s) of code"))
        if bubble.role == "user":
            bubble.edit_submitted.connect(lambda text, b=bubble: self._edit_bubble(b, text))
        else:
            bubble.regenerate_requested.connect(self.regenerate)

    def _edit_bubble(self, bubble: MessageWidget, text: str) -> None:
        if bubble in self.bubbles:
            self.edit_message(self.bubbles.index(bubble), text)

    def _drop_bubbles_from(self, index: int) -> None:
        for bubble in self.bubbles[index:]:
            self.column.removeWidget(bubble)
            bubble.hide()
            bubble.deleteLater()
        del self.bubbles[index:]

    def _on_scrolled(self, value: int) -> None:
        bar = self.scroll.verticalScrollBar()
        self._follow = value >= bar.maximum() - FOLLOW_SLACK

    def _on_range(self, lo: int, hi: int) -> None:
        if self._follow:  # keep to the end while the answer grows, unless the user scrolled up
            self.scroll.verticalScrollBar().setValue(hi)

    def _scroll_to_end(self) -> None:
        bar = self.scroll.verticalScrollBar()
        bar.setValue(bar.maximum())

    # -- worker replies ----------------------------------------------------------------------------
    def _on_loading(self, what: str) -> None:
        self.model_ready = False
        if not self.bridge.model_info:  # the first load: the big banner (a switch shows in the header)
            self.banner_text.setText(f"Loading {what}…  (first start converts the model once; later starts are quick)")
            self.banner_bar.show()
            set_tone(self.banner_text, "")
            self.banner.show()
        else:
            self.banner.hide()
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
        if self.turn is not None and rid == self.turn.rid:
            self.turn.bubble.set_footer(f"generating · mode {info.get('mode')} · prompt {info.get('prompt_tokens')} "
                                        "tokens", "muted")

    def _on_calibrating(self, rid: int, done: int, total: int, what: str) -> None:
        if self.turn is not None and rid == self.turn.rid:
            self.turn.bubble.set_footer(f"measuring this machine for speculative decoding, once per model: "
                                        f"{100 * done // max(total, 1)} % ({what}) · Stop cancels", "muted")

    def _on_text(self, rid: int, text: str) -> None:
        if self.turn is not None and rid == self.turn.rid:
            self.turn.text += text
            if not self._render_timer.isActive():
                self._render_timer.start()

    def _render_stream(self) -> None:
        turn = self.turn
        if turn is not None and turn.conv is self.conv and turn.bubble.content != turn.text:
            turn.bubble.set_text(turn.text)

    def _on_finished(self, rid: int, result: dict) -> None:
        turn = self.turn
        if turn is None or rid != turn.rid:
            return
        self.last_result = result
        self._render_timer.stop()
        text = result["text"]  # the final text is authoritative (stop strings)
        if not text.strip():
            self._drop_turn(turn, "stopped before any text" if result.get("finish_reason") == "cancelled"
                            else "the model answered nothing")
            return
        stats = {k: result[k] for k in STAT_KEYS if result.get(k) is not None}
        answer = Message("assistant", text, stats)
        self._save_turn(turn, answer)
        if turn.conv is self.conv:
            turn.bubble.set_text(text)
            turn.bubble.set_footer(turn_stats(result), "muted")
        self._say("stopped" if result.get("finish_reason") == "cancelled" else "", "")
        self._done()

    def _save_turn(self, turn: Turn, answer: Message) -> None:
        conv = turn.conv
        conv.messages[turn.position:] = [turn.user, answer]
        if conv.id in self._deleted:
            return
        try:
            if conv.id is None:
                made = self.store.create(history.title_from(turn.user.content or "Image"), conv.system_prompt,
                                         conv.settings)
                conv.id, conv.title, conv.created = made.id, made.title, made.created
            elif not conv.title and turn.position == 0:
                conv.title = history.title_from(turn.user.content or "Image")
                self.store.rename(conv.id, conv.title)
            self.store.replace_from(conv.id, turn.position, conv.messages[turn.position:])
        except (sqlite3.Error, TandemError) as err:
            self._store_failed(err)
            return
        if conv is self.conv:
            self.settings.last_conversation = conv.id
            self._show_title()
        self.refresh_list()

    def _on_failed(self, rid: int, message: str) -> None:
        if self.turn is not None and rid == self.turn.rid:
            self._drop_turn(self.turn, message, tone="bad")

    def _drop_turn(self, turn: Turn, message: str, tone: str = "muted") -> None:
        """A turn with no answer leaves the chat as it was; the question goes back to the prompt box."""
        self.turn = None
        if turn.conv is self.conv:
            self._show(self.conv)
            if not self.input.toPlainText().strip():
                self.input.setPlainText(turn.user.content)
            if not self.attachments.images:
                self.attachments.set_images(turn.user.images)
        self._say(message, tone)
        self._done()

    def _done(self) -> None:
        self.turn = None
        self._update_button()

    def shutdown(self) -> None:
        """Save what is pending (a system prompt being typed) and close the history file."""
        self.panel.flush()
        self._render_timer.stop()
        self.store.close()

    # -- dialogs (replaced in tests) ---------------------------------------------------------------
    def _ask(self, title: str, text: str) -> bool:
        return QMessageBox.question(self, title, text) == QMessageBox.StandardButton.Yes

    def _ask_path(self, title: str, suggested: str, file_filter: str) -> Optional[str]:
        path, _ = QFileDialog.getSaveFileName(self, title, str(Path.home() / suggested), file_filter)
        return path or None
