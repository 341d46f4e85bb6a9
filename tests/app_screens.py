"""Screenshots of the desktop app on the starter model (a script, not a test).

Starts the app, drives a chat (two turns), a calibration, a race, and saves one PNG per tab with
``QWidget.grab()``, in each theme asked for (light: chat.png ...; dark: chat-dark.png ...). Settings
and chat history go to a throwaway folder, never the user's:

    xvfb-run -a -s "-screen 0 1400x900x24" .venv/bin/python tests/app_screens.py /tmp/tandem-shots \
        [--demo-cache] [--demo-stores] [--demo-hub] [--race-modes lookup,dspark]
    QT_QPA_PLATFORM=offscreen .venv/bin/python tests/app_screens.py /tmp/tandem-shots   # no X at all

Takes about a minute on a 2-core CPU. Exits non-zero if any step fails or times out.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401  (OpenBLAS before mlx.core)
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.main import MainWindow, make_application  # noqa: E402

CHAT_TURNS = [
    ("auto", "In two sentences, what is a CPU cache?"),
    ("lookup", "Write a Python function that returns the squares of a list of numbers, in a code block."),
]
SUFFIX = [""]  # "-dark" while shooting the dark theme
RACE_PROMPT = ("Write a Python function is_palindrome(s) that ignores case and spaces, with a docstring, "
               "then show three example calls.")


def wait_until(app: QApplication, cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"app_screens: timed out after {timeout:.0f}s waiting for {what}")
        app.processEvents()
        time.sleep(0.01)


def settle(app: QApplication, seconds: float = 0.4) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.01)


def shoot(app: QApplication, win: MainWindow, tab, path: Path) -> None:
    path = path.with_name(path.stem + SUFFIX[0] + path.suffix)
    win.tabs.setCurrentWidget(tab)
    if tab is win.telemetry:
        win.telemetry.redraw(force=True)
    settle(app)
    if not win.grab().save(str(path)):
        raise SystemExit(f"app_screens: could not write {path}")
    print(f"saved {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder for chat.png, models.png, race.png, telemetry.png")
    p.add_argument("--model", default=None, help="model to load (default: the starter model)")
    p.add_argument("--race-modes", default="lookup", help="comma-separated modes raced against baseline")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--themes", default="light,dark", help="comma-separated: light, dark (one set of PNGs each)")
    p.add_argument("--demo-cache", action="store_true",
                   help="show a hand-built HF cache (a target, a drafter) in the Models tab instead of ~/.cache")
    p.add_argument("--demo-stores", action="store_true",
                   help="show LM Studio and Ollama stores (tiny GGUFs in their real layouts, in a temp HOME)")
    p.add_argument("--demo-hub", action="store_true",
                   help="search a local fake Hub in the Models tab (no network)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["TANDEM_APP_DATA"] = tempfile.mkdtemp(prefix="tandem-screens-")  # settings + history
    if args.demo_stores:
        from tests.test_app_stores import build_stores

        home = Path(tempfile.mkdtemp(prefix="tandem-home-"))
        build_stores(home)
        os.environ.setdefault("TANDEM_CACHE_DIR", str(Path.home() / ".cache" / "tandem"))  # keep conversions
        os.environ["HOME"] = str(home)
    fake_hub = None
    if args.demo_hub:
        from huggingface_hub import constants

        from tests.test_app_stores import demo_hub

        constants.HF_HUB_OFFLINE = False
        fake_hub = demo_hub().__enter__()

    cache_dir = None
    if args.demo_cache:
        from tests.test_app_hub import build_cache

        cache_dir = str(build_cache(Path(tempfile.mkdtemp(prefix="tandem-demo-"))))
    app = make_application()
    win = MainWindow(model=args.model, cache_dir=cache_dir, endpoint=fake_hub.url if fake_hub else None)
    win.resize(1400, 900)
    win.show()
    errors: list[str] = []
    win.bridge.model_failed.connect(errors.append)
    win.bridge.gen_failed.connect(lambda rid, msg: errors.append(msg))
    win.bridge.calib_failed.connect(lambda rid, msg: errors.append(msg))
    try:
        t0 = time.monotonic()
        wait_until(app, lambda: win.chat.model_ready or errors, 300, "the model to load")
        if errors:
            raise SystemExit(f"app_screens: {errors[0]}")
        print(f"model loaded in {time.monotonic() - t0:.1f}s: {win.model_status.text()}")

        chat = win.chat
        chat.max_tokens.setValue(args.max_tokens)
        for mode, text in CHAT_TURNS:
            chat.mode.setCurrentText(mode)
            chat.send(text)
            wait_until(app, lambda: not chat.generating, 300, f"chat reply ({mode})")
            if errors:
                raise SystemExit(f"app_screens: {errors[0]}")
            print(f"chat [{mode}]: {chat.last_result['tokens']} tokens, {chat.last_result['decode_tps']:.1f} tok/s")

        tel = win.telemetry
        tel.calibrate()
        wait_until(app, lambda: tel.calib_id is None, 300, "calibration")
        if errors:
            raise SystemExit(f"app_screens: {errors[0]}")

        race = win.race
        race.max_tokens.setValue(args.max_tokens)
        race.prompt.setPlainText(RACE_PROMPT)
        modes = [m for m in args.race_modes.split(",") if m]
        race.run(modes=["baseline"] + modes)
        wait_until(app, lambda: race.request_id is None, 600, "the race")
        wait_until(app, lambda: not race.replay_timer.isActive(), 120, "the replay")
        print(race.summary.text())
        models = win.models
        wait_until(app, lambda: not models.busy, 60, "the model list")
        if fake_hub is not None:
            panel = models.hub_panel
            panel.search_input.setText("qwen3")
            panel.format.setCurrentText("Any format")
            panel.search()
            wait_until(app, lambda: not models.busy, 60, "the Hub search")
            panel.select("Qwen/Qwen3-0.6B-GGUF")
            wait_until(app, lambda: not models.busy, 60, "the GGUF file list")
        if cache_dir:
            models.select("org/tiny-dspark")
        for name in [t for t in args.themes.split(",") if t]:
            win.set_theme(name)
            SUFFIX[0] = "" if name == "light" else f"-{name}"
            chat.show_parameters(False)
            shoot(app, win, win.chat, args.out / "chat.png")
            chat.show_parameters(True)
            shoot(app, win, win.chat, args.out / "chat-parameters.png")
            chat.show_parameters(False)
            shoot(app, win, win.race, args.out / "race.png")
            shoot(app, win, win.telemetry, args.out / "telemetry.png")
            shoot(app, win, win.models, args.out / "models.png")
    finally:
        win.shutdown()
        win.close()
        if fake_hub is not None:
            fake_hub.__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
