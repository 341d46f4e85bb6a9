"""App helpers without Qt: race verdicts, telemetry buffers and maths, the MLX boundary, `tandem app`."""

from __future__ import annotations

import ast
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from app.race_verdict import (TIE_MARGIN, first_divergence, replay_length, speedup, token_diff, token_sources,
                              verdict, visible_tokens)
from app.telemetry_model import (TelemetryBuffer, acceptance_series, ceiling_curve, ceiling_tps, kv_bytes_at,
                                 live_tps)

ROOT = Path(__file__).resolve().parents[1]


# -- race verdicts ----------------------------------------------------------------------------------
def test_verdict_identical():
    v = verdict([5, 6, 7, 8], [5, 6, 7, 8])
    assert v.status == "identical" and v.index is None and v.ok
    assert token_diff([5, 6, 7, 8], [5, 6, 7, 8]) == ["same"] * 4


def test_verdict_an_early_stop_is_a_divergence():
    """Same budget, greedy: a lane ending (EOS) where baseline goes on is a divergence at that
    position, EOS versus baseline's token, reported with its margin like any other."""
    v = verdict([5, 6, 7, 8], [5, 6, 7], token_text={8: "cat"})
    assert v.status == "diverged" and (v.index, v.expected, v.got) == (3, 8, None) and not v.ok
    assert "token 3" in v.text and "'cat'" in v.text and "this lane end of output (EOS)" in v.text
    bug = verdict([5, 6, 7, 8], [5, 6, 7], margin=4.0, gap=4.0, candidate_finish="stop")
    assert bug.status == "diverged" and not bug.ok and "bug" in bug.text
    tie = verdict([5, 6, 7, 8], [5, 6, 7], margin=0.0, gap=0.0, candidate_finish="stop")
    assert tie.status == "diverged" and tie.ok and "tie" in tie.text
    # going on where baseline ended is the same divergence seen from the other side
    v = verdict([5, 6], [5, 6, 9], reference_finish="stop", candidate_finish="length")
    assert v.status == "diverged" and (v.index, v.expected, v.got) == (2, None, 9)
    assert first_divergence([5, 6], [5, 6, 9]) == 2 and first_divergence([5, 6], [5, 6]) is None
    assert token_diff([5, 6], [5, 6, 9, 4]) == ["same", "same", "diverged", "after"]
    assert token_diff([5, 6, 7, 8], [5, 6, 7]) == ["same"] * 3


def test_verdict_a_lane_the_user_stopped_is_not_a_divergence():
    v = verdict([5, 6, 7, 8], [5, 6], candidate_finish="cancelled")
    assert v.status == "cancelled" and v.ok and "stopped by the user" in v.text
    # ... unless it differed before the stop, or it is the longer lane that was cancelled
    assert verdict([5, 6, 7, 8], [5, 9], candidate_finish="cancelled").status == "diverged"
    assert verdict([5, 6], [5, 6, 7], reference_finish="stop", candidate_finish="cancelled").status == "diverged"


def test_token_sources_follow_the_rounds():
    # (accepted, committed, drafted_by): the prefill token, a lookup round with 2 of 3 accepted,
    # a baseline-like step, a drafter round fully accepted, a drafter round cut by EOS after 1
    rounds = [(0, 1, ""), (2, 3, "lookup"), (0, 1, ""), (3, 4, "dspark"), (2, 1, "dflash"), (0, 0, "lookup")]
    assert token_sources(rounds) == ["target", "lookup", "lookup", "target", "target", "drafter", "drafter",
                                     "drafter", "target", "drafter"]
    assert token_sources([(0, 1, "")] * 3) == ["target"] * 3


def test_verdict_planted_divergence_names_position_and_tokens():
    ref = [10, 11, 12, 13, 14, 15]
    cand = [10, 11, 12, 40, 14, 15]
    assert first_divergence(ref, cand) == 3
    v = verdict(ref, cand, token_text={13: "cat", 40: "dog"})
    assert v.status == "diverged" and (v.index, v.expected, v.got) == (3, 13, 40)
    assert "token 3" in v.text and "'cat'" in v.text and "'dog'" in v.text
    assert v.is_tie is None and not v.ok  # unexplained until the worker measures the margin
    assert token_diff(ref, cand) == ["same", "same", "same", "diverged", "after", "after"]


def test_verdict_margin_decides_tie_or_bug():
    ref, cand = [1, 2, 3], [1, 2, 4]
    tie = verdict(ref, cand, margin=0.0, gap=0.0)
    assert tie.status == "diverged" and tie.is_tie and tie.ok and "tie" in tie.text
    near = verdict(ref, cand, margin=TIE_MARGIN / 2)
    assert near.is_tie and "top-2 logit margin" in near.text
    bug = verdict(ref, cand, margin=2.5, gap=2.5)
    assert bug.is_tie is False and not bug.ok and "bug" in bug.text
    # the gap to this lane's token wins over the top-2 margin when both are known
    assert verdict(ref, cand, margin=0.01, gap=3.0).is_tie is False


def test_verdict_sampled_lanes_are_not_judged():
    v = verdict([1, 2, 3], [1, 9, 3], greedy=False)
    assert v.status == "sampled" and v.ok and v.index == 1


def test_replay_helpers():
    times = [0.10, 0.20, 0.20, 0.35]
    assert [visible_tokens(times, t) for t in (0.0, 0.1, 0.2, 0.3, 1.0)] == [0, 1, 3, 3, 4]
    assert replay_length([[0.1, 0.5], [0.2, 0.9], []]) == 0.9
    assert speedup(20.0, 10.0) == 2.0 and speedup(5.0, 0.0) is None


# -- telemetry ----------------------------------------------------------------------------------------
def _event(i, drafted, accepted, t, context=100):
    return {"index": i, "t": t, "drafted": drafted, "accepted": accepted, "committed": accepted + 1,
            "cap": 4, "context": context + i, "generated": i, "mode": "lookup"}


def test_telemetry_buffer_is_bounded_and_thread_safe():
    buf = TelemetryBuffer(max_rounds=64, max_points=8)
    buf.begin("chat")

    def produce(k):
        for i in range(500):
            buf.push_round(_event(i, 2, 1, i * 0.01))
            if i % 50 == 0:
                buf.push_point({"mode": "lookup", "tps": float(k), "context": 10.0, "speculative": True})

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    snaps = [buf.snapshot() for _ in range(200)]  # read while writers run
    for t in threads:
        t.join()
    snap = buf.snapshot()
    assert len(snap.rounds) == 64 and len(snap.points) == 8
    assert snap.version == 1 + 4 * 500 + 4 * 10
    assert all(len(s.rounds) <= 64 for s in snaps)
    buf.begin("race | baseline")
    assert buf.snapshot().rounds == [] and buf.snapshot().label == "race | baseline"


def test_acceptance_series_and_live_rate():
    rounds = [_event(0, 0, 0, 0.0)] + [_event(i, 4, a, 0.1 * i) for i, a in enumerate([3, 1, 0, 4], start=1)]
    idx, drafted, accepted, mean = acceptance_series(rounds)
    assert idx == [1, 2, 3, 4] and drafted == [4, 4, 4, 4] and accepted == [3, 1, 0, 4]
    assert mean == pytest.approx([4.0, 3.0, 7 / 3, 3.0])  # tokens per round = accepted + 1
    # committed tokens after the first speculative round over the time they took
    assert live_tps(rounds) == pytest.approx((2 + 1 + 5) / (0.4 - 0.1))
    assert live_tps(rounds[:2]) is None


def test_roofline_ceiling():
    assert ceiling_tps(100e9, 1e9) == pytest.approx(100.0)
    assert ceiling_tps(100e9, 1e9, 1e6, 1000) == pytest.approx(50.0)  # KV doubles the bytes at 1000 tokens
    assert ceiling_tps(0, 1e9) == 0.0
    # per-layer KV with a sliding window stops growing past the window (engine.roofline.KVProfile)
    kv = {"layers": [[1e6, None], [1e6, 100]], "state": 0}
    assert kv_bytes_at(kv, 50) == 1e8 and kv_bytes_at(kv, 1000) == 1e9 + 1e8
    xs, ys = ceiling_curve(100e9, 1e9, 1e6, 1000, n=11)
    assert xs[0] == 0 and xs[-1] == 1000 and ys[0] == pytest.approx(100.0) and ys == sorted(ys, reverse=True)


# -- boundaries ----------------------------------------------------------------------------------------
MLX_MODULES = ("mlx", "mlx_lm", "engine.generate", "engine.api", "engine.target", "engine.speculative",
               "engine.sampling", "engine.modes", "engine.loading", "engine.drafters", "engine.detokenize",
               "engine.calibrate", "engine.roofline", "tests.tiny")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_only_the_worker_imports_mlx_or_engine_model_code():
    offenders = {}
    for path in sorted((ROOT / "app").rglob("*.py")):
        bad = {n for n in _imports(path) if any(n == m or n.startswith(m + ".") for m in MLX_MODULES)}
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert set(offenders) <= {"app/worker.py"}, offenders
    assert "app/worker.py" in offenders  # the worker is where MLX lives


GUI_WITHOUT_MLX = """
import sys
from PySide6.QtWidgets import QApplication
from app.bridge import Bridge
from app.views.chat import ChatView
from app.views.models import ModelsView
from app.views.race import RaceView
from app.views.telemetry import TelemetryView
import app.main, app.hub

qapp = QApplication([])
bridge = Bridge()
bridge.pairs = [{"target": "Qwen/Qwen3-4B", "mode": "dspark", "drafter": "org/d"}]
views = [ChatView(bridge), ModelsView(bridge), RaceView(bridge), TelemetryView(bridge)]
views[1].refresh()          # lists built-ins, the HF cache and other apps' stores (a background thread)
while views[1].busy:
    qapp.processEvents()
views[1].hub_panel.search()  # a Hub search (offline here: a one-line error)
while views[1].busy:
    qapp.processEvents()
assert "offline" in views[1].hub_panel.status.text(), views[1].hub_panel.status.text()
views[3].redraw(force=True)
bad = [m for m in sys.modules if m == "mlx" or m.startswith("mlx.") or m.startswith("mlx_lm")]
print(bad)
sys.exit(1 if bad else 0)
"""


def test_gui_code_paths_do_not_load_mlx(tmp_path):
    """Building every view and listing models must not import MLX in the GUI thread: only the
    worker thread touches it."""
    env = {"QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", GUI_WITHOUT_MLX], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cli_app_reports_missing_pyside(monkeypatch):
    import argparse

    from engine.cli import app as cli_app
    from engine.errors import TandemError

    real = cli_app.importlib.util.find_spec
    monkeypatch.setattr(cli_app.importlib.util, "find_spec", lambda name: None if name == "PySide6" else real(name))
    p = argparse.ArgumentParser()
    cli_app.add_arguments(p)
    with pytest.raises(TandemError, match="needs PySide6: pip install"):
        cli_app.run(p.parse_args([]))


def test_modes_match_the_engine():
    from app.views.common import MODE_HELP, MODES
    from engine.generate import MODES as ENGINE_MODES

    assert MODES == ENGINE_MODES and set(MODE_HELP) == set(MODES)
