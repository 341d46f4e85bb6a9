"""--max-draft auto per batch width: the calibration's batched verify curves, the cost model at a
batch size, and a controller that speculates alone but parks in a batch where batched plain
steps win."""

from __future__ import annotations

from engine.calibrate import BATCH_ROWS, calibrate
from engine.cap_controller import CapController
from engine.cost_model import Calibration, best_cap
from tests.tiny import make_tiny_engine


def batched(one_row: list[float], per_row_width: float) -> Calibration:
    """One-row curve ``one_row``; a batch of B rows costs the one-row step plus, per extra row and
    width, ``per_row_width`` ms (a machine where batching fills the compute)."""
    cal = Calibration.synthetic(one_row, max_cap=len(one_row) - 1, plain_ms=one_row[0], overhead_ms=0.1)
    cal.batch_widths = cal.widths[:6]
    cal.batch_verify_ms = {str(b): [one_row[0] + (b * w - 1) * per_row_width for w in cal.batch_widths]
                           for b in (2, 4, 8)}
    return cal


def test_at_batch_interpolates_and_scales_the_curves():
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    assert cal.at_batch(1) is cal
    four = cal.at_batch(4)
    assert four.verify(1) == cal.batch_verify_ms["4"][0] and four.verify(3) == cal.batch_verify_ms["4"][2]
    three = cal.at_batch(3)  # halfway between 2 and 4
    assert three.verify(2) == (cal.batch_verify_ms["2"][1] + cal.batch_verify_ms["4"][1]) / 2
    assert four.verify(9) > four.verify(6) > four.verify(1)  # beyond the measured widths: scaled like one row
    assert four.plain_ms == cal.plain_ms * four.verify(1) / cal.verify(1) and four.overhead_ms == 4 * cal.overhead_ms
    assert cal.at_batch(16).verify(2) == cal.batch_verify_ms["8"][1]  # past the largest batch: its curve
    assert Calibration.from_dict(cal.to_dict()).at_batch(4).verify(3) == four.verify(3)  # survives the cache


def test_auto_parks_in_a_batch_where_batched_plain_steps_win():
    # Alone a verify of 5 costs 1.2 plain steps (memory-bound): cap > 0 at p = 0.7. In a batch of 8
    # every extra row-width costs 2 ms of a 10 ms step: plain steps win.
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    assert best_cap(cal, 0.7) > 0 and best_cap(cal.at_batch(8), 0.7) == 0
    policy = CapController(cal, 8)
    policy.batch_rows(8)
    assert policy.cal.verify(2) == cal.at_batch(8).verify(2)
    seeded = CapController(cal, 8, seeded=True)
    seeded.batch_rows(8)
    assert seeded.cal is cal  # a seeded request's caps do not depend on the batch


def test_calibration_measures_batched_verify_curves():
    eng = make_tiny_engine("llama")
    cal = calibrate(eng, "lookup", recalibrate=True, passes=1, context=64, overhead_rounds=2)
    assert sorted(int(b) for b in cal.batch_verify_ms) == list(BATCH_ROWS)
    assert cal.batch_widths == [w for w in cal.widths if w <= 9]
    for b, curve in cal.batch_verify_ms.items():
        assert len(curve) == len(cal.batch_widths) and all(ms > 0 for ms in curve)
    assert cal.at_batch(4).verify(1) > 0
