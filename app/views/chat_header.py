"""The Chat tab's top rows: the chat's title and the Parameters toggle; the model (switchable from
here, with its drafter and a load indicator), the Think toggle (for models whose chat template
has a thinking switch) and the decoding mode (modes the model cannot run are greyed, with the
reason).

The model list and loading are the Models tab's: the main window hands the header its ``entries``
and ``load_entry`` (a header on its own lists nothing and loads by name)."""

from __future__ import annotations

from typing import Callable, Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QProgressBar, QPushButton, QVBoxLayout, QWidget

from app import hub
from app.bridge import Bridge
from app.views.chat_widgets import ElidedLabel
from app.views.common import MODE_HELP, MODES, hbox, plain_label


class ChatHeader(QWidget):
    notice = Signal(str)  # something the user should know (a mode switched to auto)

    def __init__(self, bridge: Bridge):
        super().__init__()
        self.bridge = bridge
        self.entries: Callable[[], list[hub.ModelEntry]] = list
        self.load_entry: Callable[[hub.ModelEntry], None] = lambda e: self.switch_model(e.spec)
        self.title = ElidedLabel("chatTitle")
        self.model_box = QComboBox()  # refilled whenever the Models tab lists (scan, download, evict)
        self.model_box.setObjectName("modelPicker")
        self.model_box.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.model_box.setMinimumContentsLength(22)
        self.model_box.setToolTip("The model that answers; switching keeps this chat")
        self.model_box.activated.connect(self._on_model_chosen)
        self.drafter_label = plain_label("", "hint", wrap=False)
        self.load_bar = QProgressBar()
        self.load_bar.setRange(0, 0)
        self.load_bar.setFixedSize(70, 8)
        self.load_bar.setTextVisible(False)
        self.load_bar.hide()
        self.mode = QComboBox()
        self.mode.addItems(MODES)
        for i, m in enumerate(MODES):
            self.mode.setItemData(i, MODE_HELP[m], Qt.ToolTipRole)
        self.mode.setToolTip("Decoding mode for this chat")
        self.think = QPushButton("Think")  # shown for models whose chat template has the switch
        self.think.setObjectName("secondary")
        self.think.setCheckable(True)
        self.think.setChecked(True)
        self.think.setToolTip("Let the model reason before it answers (the chat template's enable_thinking)")
        self.think.hide()
        self.params_button = QPushButton("Parameters")
        self.params_button.setObjectName("secondary")
        self.params_button.setCheckable(True)
        self.params_button.setToolTip("System prompt and sampling for this chat")
        rows = QVBoxLayout(self)
        rows.setContentsMargins(0, 0, 0, 0)
        rows.setSpacing(6)
        rows.addLayout(hbox((self.title, 1), self.params_button))
        rows.addLayout(hbox(plain_label("Model", "fieldLabel", wrap=False), self.model_box, self.load_bar,
                            self.drafter_label, None, self.think, plain_label("Mode", "fieldLabel", wrap=False),
                            self.mode))

        bridge.model_loading.connect(self._on_loading)
        bridge.model_loaded.connect(self._on_loaded)
        bridge.model_failed.connect(self._on_failed)
        self.refresh_models()

    # -- the model list ------------------------------------------------------------------------------
    def loadable(self) -> list[hub.ModelEntry]:
        return [e for e in self.entries() if e.kind == "target" and e.installed and e.complete and not e.problem]

    def refresh_models(self) -> None:
        """The targets that can be loaded, the loaded one selected."""
        info = self.bridge.model_info
        box = self.model_box
        box.blockSignals(True)
        box.clear()
        current = -1
        for e in self.loadable():
            box.addItem(e.display_name or e.name, e.key)
            box.setItemData(box.count() - 1, f"{e.name} · {e.size_str}" + (f" · drafter {e.pair}" if e.pair else ""),
                            Qt.ToolTipRole)
            if current < 0 and hub.entry_is_loaded(e, info):
                current = box.count() - 1
        if current < 0:  # loaded from elsewhere (a path...), or nothing loaded yet
            box.insertItem(0, info.get("name", "?") if info else "no model", info.get("spec") if info else None)
            current = 0
        box.setCurrentIndex(current)
        box.blockSignals(False)

    def _on_model_chosen(self, index: int) -> None:
        key = self.model_box.itemData(index)
        entry = next((e for e in self.loadable() if e.key == key), None)
        if entry is not None and not hub.entry_is_loaded(entry, self.bridge.model_info):
            self.load_entry(entry)

    def switch_model(self, spec: Optional[str], drafter: Optional[str] = None) -> None:
        """Load another model in the worker; the chat stays and continues with it."""
        self.bridge.load(spec, drafter)

    # -- load state ----------------------------------------------------------------------------------
    def _on_loading(self, what: str) -> None:
        self.load_bar.show()
        self.model_box.setEnabled(False)
        if self.bridge.model_info:
            self.drafter_label.setText(f"loading {what}…")

    def _on_loaded(self, info: dict) -> None:
        self._idle(info)
        self.apply_mode_support(info.get("mode_support"))
        self.think.setVisible(bool(info.get("thinking_switch")))

    def _on_failed(self, message: str) -> None:
        self._idle(self.bridge.model_info)  # back to the model still loaded

    def _idle(self, info: dict) -> None:
        self.load_bar.hide()
        self.model_box.setEnabled(True)
        self._show_drafter(info)
        self.refresh_models()

    def _show_drafter(self, info: dict) -> None:
        """The drafter next to the model: the one loaded with it, else the one auto picks."""
        drafter = info.get("drafter") or info.get("auto_drafter") if info else None
        auto = info.get("auto_mode") if info else None
        if not info:
            text, tip = "", ""
        elif drafter:
            text = f"+ {drafter.rstrip('/').split('/')[-1]}"
            tip = f"drafter {drafter}" + (f"\nauto runs {auto}" if auto else "")
        else:
            text = "no drafter" + (f" · auto = {auto}" if auto else "")
            tip = "no drafter model for this target: auto uses prompt lookup; load one from the Models tab"
        self.drafter_label.setText(text)
        self.drafter_label.setToolTip(tip)

    def apply_mode_support(self, support: Optional[dict]) -> None:
        """Grey out the modes this model cannot run (the reason as tooltip); None: all offered."""
        box, known = self.mode, support or {}
        for i in reversed(range(box.count())):  # modes only a previous model offered
            if box.itemText(i) not in MODES and box.itemText(i) not in known:
                box.removeItem(i)
        for mode in known:
            if box.findText(mode) < 0:
                box.addItem(mode)
        for i in range(box.count()):
            mode = box.itemText(i)
            why = known.get(mode)
            item = box.model().item(i)
            item.setEnabled(why is None)
            help_text = MODE_HELP.get(mode, mode)
            item.setToolTip(help_text if why is None else f"{help_text}\nunavailable: {why}")
        current = box.currentText()
        if known.get(current) is not None and known.get("auto", "") is None:
            self.notice.emit(f"mode {current} is not available with this model ({known[current]}); using auto")
            box.setCurrentText("auto")
