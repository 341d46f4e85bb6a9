"""`tandem app` on a Linux box without a screen says so in one line instead of Qt aborting."""

from __future__ import annotations

import sys

import pytest

from engine.cli import app as cli_app


@pytest.mark.skipif(sys.platform != "linux", reason="the check is Linux-only")
def test_headless_linux_gets_a_clear_message(monkeypatch, capsys):
    from engine.cli import main

    for var in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    assert "xvfb-run" in cli_app.no_display_reason()
    assert main(["app", "--quit-after", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: error: no display found") and len(err.splitlines()) == 1
    monkeypatch.setenv("DISPLAY", ":99")
    assert cli_app.no_display_reason() is None
    monkeypatch.delenv("DISPLAY")
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    assert cli_app.no_display_reason() is None
