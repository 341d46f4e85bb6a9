"""What the app remembers between runs, and where: preferences in ``QSettings`` (the platform's
native store under organisation/application "Tandem"), chat history in the app-data folder
(``QStandardPaths.AppDataLocation``).

``TANDEM_APP_DATA=/some/folder`` puts both there instead (settings.ini + the history file): a
portable install, and how the tests keep away from the user's real settings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from PySide6.QtCore import QByteArray, QSettings, QStandardPaths

ORGANISATION = "Tandem"
APPLICATION = "Tandem"
ENV_DATA = "TANDEM_APP_DATA"
HISTORY_FILE = "conversations.sqlite3"
DEFAULT_SERVE_PORT = 8080  # tandem serve's

# Sampling and mode for a new conversation until the user saves their own defaults.
SAMPLING_DEFAULTS = {"mode": "auto", "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 1024, "seed": -1,
                     "thinking": True}


def _flag(value: Any) -> bool:
    """A bool from JSON (true/false) or QSettings (which may hand back "true"/"false" strings)."""
    if isinstance(value, str):
        if value.strip().lower() not in ("true", "false", "1", "0"):
            raise ValueError(value)
        return value.strip().lower() in ("true", "1")
    return bool(value)


SAMPLING_TYPES = {"mode": str, "temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "seed": int,
                  "thinking": _flag}  # thinking: the chat template's enable_thinking, where it has the switch


def data_dir() -> Path:
    """The folder for the chat history: $TANDEM_APP_DATA, else the platform's app-data folder
    (``~/Library/Application Support/Tandem/Tandem``, ``~/.local/share/Tandem/Tandem``, ...)."""
    env = os.environ.get(ENV_DATA)
    if env:
        return Path(env).expanduser()
    location = QStandardPaths.writableLocation(QStandardPaths.AppDataLocation)
    return Path(location) if location else Path.home() / ".tandem"


def history_path() -> Path:
    return data_dir() / HISTORY_FILE


def sampling_settings(raw: Any) -> dict:
    """A sampling dict with every key present and typed; unknown keys and bad values give way to
    the defaults (a hand-edited or older settings file never breaks a chat)."""
    out = dict(SAMPLING_DEFAULTS)
    if isinstance(raw, dict):
        for key, kind in SAMPLING_TYPES.items():
            try:
                if raw.get(key) is not None:
                    out[key] = kind(raw[key])
            except (TypeError, ValueError):
                pass
    return out


class AppSettings:
    """Typed access to the preferences. Values are written through at once (``QSettings`` syncs
    to disk on its own and at exit; ``sync()`` forces it)."""

    def __init__(self, store: Optional[QSettings] = None):
        if store is None:
            env = os.environ.get(ENV_DATA)
            if env:
                store = QSettings(str(Path(env).expanduser() / "settings.ini"), QSettings.IniFormat)
            else:
                store = QSettings(ORGANISATION, APPLICATION)
        self.store = store

    def _get(self, key: str, default, kind):
        try:
            value = self.store.value(key, default)
            return default if value is None else kind(value)
        except (TypeError, ValueError):
            return default

    # -- new-conversation defaults ---------------------------------------------------------------
    def sampling_defaults(self) -> dict:
        return sampling_settings({k: self._get(f"defaults/{k}", v, SAMPLING_TYPES[k])
                                  for k, v in SAMPLING_DEFAULTS.items()})

    def set_sampling_defaults(self, values: dict) -> None:
        for key, value in sampling_settings(values).items():
            self.store.setValue(f"defaults/{key}", value)

    # -- appearance ------------------------------------------------------------------------------
    @property
    def theme(self) -> str:
        value = self._get("appearance/theme", "system", str)
        return value if value in ("system", "light", "dark") else "system"

    @theme.setter
    def theme(self, value: str) -> None:
        self.store.setValue("appearance/theme", value)

    @property
    def font_size(self) -> float:
        """Points; 0 = the platform's default."""
        return self._get("appearance/font_size", 0.0, float)

    @font_size.setter
    def font_size(self, value: float) -> None:
        self.store.setValue("appearance/font_size", float(value))

    # -- local server (app.serving) --------------------------------------------------------------
    @property
    def serve_on(self) -> bool:
        """The switch was on when the app closed: it comes on again once a model is loaded."""
        return self._get("serve/on", "false", str).lower() == "true"

    @serve_on.setter
    def serve_on(self, value: bool) -> None:
        self.store.setValue("serve/on", "true" if value else "false")

    @property
    def serve_port(self) -> int:
        value = self._get("serve/port", DEFAULT_SERVE_PORT, int)
        return value if 0 <= value <= 65535 else DEFAULT_SERVE_PORT

    @serve_port.setter
    def serve_port(self, value: int) -> None:
        self.store.setValue("serve/port", int(value))

    @property
    def serve_api_key(self) -> str:
        return self._get("serve/api_key", "", str)

    @serve_api_key.setter
    def serve_api_key(self, value: str) -> None:
        self.store.setValue("serve/api_key", value)

    # -- session ---------------------------------------------------------------------------------
    @property
    def last_conversation(self) -> Optional[int]:
        value = self._get("session/last_conversation", -1, int)
        return value if value >= 0 else None

    @last_conversation.setter
    def last_conversation(self, value: Optional[int]) -> None:
        self.store.setValue("session/last_conversation", -1 if value is None else int(value))

    @property
    def show_parameters(self) -> bool:
        return self._get("session/show_parameters", "false", str).lower() == "true"

    @show_parameters.setter
    def show_parameters(self, value: bool) -> None:
        self.store.setValue("session/show_parameters", "true" if value else "false")

    @property
    def window_geometry(self) -> Optional[QByteArray]:
        value = self.store.value("session/window_geometry")
        return value if isinstance(value, QByteArray) and not value.isEmpty() else None

    @window_geometry.setter
    def window_geometry(self, value: QByteArray) -> None:
        self.store.setValue("session/window_geometry", value)

    def sync(self) -> None:
        self.store.sync()
