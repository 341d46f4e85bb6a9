"""The local server switch (in the Models tab): serve the loaded model to other programs through
the OpenAI and Anthropic endpoints, on this machine only, with an optional API key. The worker
does the serving (app.serving); this panel only asks and shows what it answers."""

from __future__ import annotations

from typing import Optional

from PySide6.QtWidgets import QCheckBox, QLineEdit, QSpinBox, QWidget

from app.bridge import Bridge
from app.settings import AppSettings
from app.views.common import Card, hbox, plain_label, set_tone


class ServePanel(Card):
    def __init__(self, bridge: Bridge, settings: AppSettings, parent: Optional[QWidget] = None):
        super().__init__("Local server", parent)
        self.bridge = bridge
        self.settings = settings
        self.switch = QCheckBox("Serve the loaded model on this machine")
        self.switch.setToolTip("OpenAI (/v1/chat/completions) and Anthropic (/v1/messages) endpoints on 127.0.0.1, "
                               "sharing the model and its batch with the chat: nothing is loaded twice")
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setSpecialValueText("any free port")
        self.port.setPrefix("port ")
        self.port.setValue(settings.serve_port)
        self.api_key = QLineEdit(settings.serve_api_key)
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.api_key.setPlaceholderText("API key (optional)")
        self.api_key.setToolTip("When set, every request but /health must carry it "
                                "(Authorization: Bearer KEY or x-api-key: KEY), as with tandem serve --api-key")
        self.api_key.setFixedWidth(200)
        self.status = plain_label("off", "hint")
        self.body.addLayout(hbox((self.switch, 0), self.port, self.api_key, (self.status, 1)))
        self.switch.toggled.connect(self._on_switch)
        self.port.valueChanged.connect(lambda value: setattr(self.settings, "serve_port", value))
        self.api_key.textChanged.connect(lambda text: setattr(self.settings, "serve_api_key", text))
        bridge.serving_changed.connect(self._on_state)
        bridge.model_loaded.connect(self._on_model)
        self.want = settings.serve_on  # switched on at the last run: on again once a model is loaded
        self._failed = False

    @property
    def on(self) -> bool:
        return bool(self.bridge.serving.get("on"))

    def set_on(self, on: bool) -> None:
        """What the switch does (the tests call it too)."""
        self.switch.setChecked(on)

    def _on_switch(self, checked: bool) -> None:
        self.port.setEnabled(not checked)
        self.api_key.setEnabled(not checked)
        if self._failed:  # the server did not start: the switch goes back, the saved wish stays
            return
        self.settings.serve_on = checked
        self.want = checked
        if checked == self.on:
            return
        if checked:
            self.status.setText("starting…")
            set_tone(self.status, "")
            self.bridge.serve(self.port.value(), self.api_key.text().strip() or None)
        else:
            self.bridge.serve(None)

    def _on_model(self, _info: dict) -> None:
        if self.want and not self.on and not self.switch.isChecked():
            self.switch.setChecked(True)

    def _on_state(self, state: dict) -> None:
        if state.get("error"):
            self.status.setText(f"not serving: {state['error']}")
            set_tone(self.status, "bad")
        elif state.get("on"):
            url, busy = state.get("url"), state.get("in_flight") or 0
            key = " · API key required" if state.get("api_key") else ""
            self.status.setText(f"{url}/v1 (OpenAI) · {url} (Anthropic){key}"
                                + (f" · {busy} request{'s' if busy != 1 else ''} in flight" if busy else ""))
            set_tone(self.status, "good")
        else:
            busy = state.get("in_flight") or 0
            self.status.setText("off" + (f" · finishing {busy} request{'s' if busy != 1 else ''}" if busy else ""))
            set_tone(self.status, "")
        if not state.get("on") and self.switch.isChecked() and state.get("error"):
            self.want, self._failed = False, True
            self.switch.setChecked(False)
            self._failed = False
