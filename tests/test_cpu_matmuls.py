"""engine.cpu_matmuls: the first load of a model on a machine times Tandem's skinny loops against
OpenBLAS's gemm on the model's own forwards and keeps the faster, cached for later loads."""

from __future__ import annotations

import json

import pytest

from engine import cpu_matmuls, platform
from tests.tiny import make_tiny_engine

pytestmark = pytest.mark.skipif(not platform.skinny_installed() or platform.backend() != "cpu",
                                reason="the skinny loops are not installed here (no compiler or no OpenBLAS)")


@pytest.fixture
def target(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_matmuls.FORCE_ENV, raising=False)  # the suite pins the loops; these tests choose
    monkeypatch.setattr(cpu_matmuls, "MIN_BYTES", 0)  # the tiny model counts as large
    yield make_tiny_engine().target
    platform.skinny_matmuls(True)  # as every other test expects


def costs(skinny_ms, gemm_ms):
    """A deterministic stand-in for the timed forwards; records the settings it was asked for."""
    asked = []

    def measure(skinny: bool):
        asked.append(skinny)
        return skinny_ms if skinny else gemm_ms

    return measure, asked


def refuse(skinny: bool):
    raise AssertionError("measured again although the choice was cached")


def test_gemm_that_wins_replaces_the_loops_and_later_loads_read_the_choice(target):
    measure, asked = costs([80.0, 110.0], [70.0, 100.0])
    choice = cpu_matmuls.choose(target, measure=measure, rounds=2)
    assert asked == [True, False, True, False]  # interleaved
    assert not choice.skinny and not choice.cached and not platform.skinny_active()
    assert choice.skinny_ms == [80.0, 110.0] and choice.gemm_ms == [70.0, 100.0]
    assert "OpenBLAS's gemm" in choice.describe() and "8 rows 110.0 vs 100.0 ms" in choice.describe()

    platform.skinny_matmuls(True)  # a new process starts with the loops on
    again = cpu_matmuls.choose(target, measure=refuse)
    assert again.cached and not again.skinny and not platform.skinny_active()
    stored = json.loads(cpu_matmuls._path().read_text())
    assert list(stored) == [cpu_matmuls.choice_key(target)]


def test_a_first_load_reports_each_measurement_and_drops_an_older_kernels_records(target):
    stale = cpu_matmuls.choice_key(target).replace("|skinny-", "|skinny-0ld")
    cpu_matmuls._path().parent.mkdir(parents=True)
    cpu_matmuls._path().write_text(json.dumps({stale: {"skinny": False, "skinny_ms": [1.0, 2.0], "gemm_ms": [1.0, 2.0],
                                                       "measured": "then"}}))
    heard = []
    choice = cpu_matmuls.choose(target, measure=costs([70.0, 100.0], [80.0, 110.0])[0], rounds=2,
                                progress=lambda done, total, stage: heard.append((done, total, stage)))
    assert choice.skinny and not choice.cached
    assert [(d, t) for d, t, _ in heard] == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert [s for _, _, s in heard[:2]] == ["Tandem's skinny loops", "OpenBLAS's gemm"]
    assert list(json.loads(cpu_matmuls._path().read_text())) == [cpu_matmuls.choice_key(target)]
    heard.clear()
    cpu_matmuls.choose(target, measure=refuse, progress=lambda *a: heard.append(a))
    assert heard == []  # read from the cache: nothing to report


def test_the_loops_stay_unless_gemm_wins_by_the_margin(target):
    close = [x / (cpu_matmuls.MARGIN - 0.01) for x in (70.0, 100.0)]  # gemm ahead, inside the margin
    choice = cpu_matmuls.choose(target, measure=costs(close, [70.0, 100.0])[0])
    assert choice.skinny and platform.skinny_active()


def test_each_setting_keeps_its_cheapest_median_over_the_rounds(target):
    """Contention only adds time: a burst in one round does not decide."""
    runs = iter([[90.0, 140.0], [70.0, 100.0], [80.0, 110.0], [95.0, 130.0]])  # skinny, gemm, skinny, gemm
    choice = cpu_matmuls.choose(target, measure=lambda skinny: next(runs), rounds=2)
    assert choice.skinny_ms == [80.0, 110.0] and choice.gemm_ms == [70.0, 100.0] and not choice.skinny


def test_a_small_model_or_a_damaged_cache_changes_nothing_for_the_worse(target, monkeypatch):
    monkeypatch.setattr(cpu_matmuls, "MIN_BYTES", 1 << 40)
    assert cpu_matmuls.choose(target, measure=refuse) is None and platform.skinny_active()
    assert not cpu_matmuls._path().exists()
    monkeypatch.setattr(cpu_matmuls, "MIN_BYTES", 0)
    cpu_matmuls._path().parent.mkdir(parents=True)
    cpu_matmuls._path().write_text("{not json")
    choice = cpu_matmuls.choose(target, measure=costs([70.0, 100.0], [80.0, 110.0])[0])
    assert choice.skinny and not choice.cached  # measured again, and the file rewritten whole
    assert json.loads(cpu_matmuls._path().read_text())[cpu_matmuls.choice_key(target)]["skinny"] is True


def test_real_forwards_are_timed_with_each_setting_and_leave_the_model_as_it_was(target):
    """The real measurement: a plain step and a verify of 8 rows on the model's own cache, each
    setting in turn; the forwards are rolled back, so the same prompt gives the same logits after."""
    import mlx.core as mx

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    before, _ = target.prefill(prompt, target.new_cache())
    seen = []
    timed = cpu_matmuls.timed_forwards(target, passes=1)

    def measure(skinny: bool):
        ms = timed(skinny)
        seen.append(platform.skinny_active())
        return ms

    choice = cpu_matmuls.choose(target, measure=measure, rounds=1)
    assert seen == [True, False]
    assert len(choice.skinny_ms) == len(choice.gemm_ms) == len(cpu_matmuls.WIDTHS)
    assert all(ms > 0 for ms in choice.skinny_ms + choice.gemm_ms)
    assert choice.skinny == (sum(choice.gemm_ms) * cpu_matmuls.MARGIN >= sum(choice.skinny_ms))
    assert platform.skinny_active() == choice.skinny
    platform.skinny_matmuls(True)
    after, _ = target.prefill(prompt, target.new_cache())
    assert mx.array_equal(before, after).item()


def test_the_key_names_the_machine_the_blas_and_the_model(target):
    from engine.calibrate import model_precision, shape_signature

    key = cpu_matmuls.choice_key(target)
    assert platform.device_name() in key and "skinny-" in key
    assert shape_signature(target.model) in key and model_precision(target.model) in key
    assert shape_signature(target.model) not in cpu_matmuls.choice_key(make_tiny_engine(seed=1, layers=3).target)


def test_doctor_names_the_matmuls_and_the_times_that_chose_them(target):
    from engine.doctor import model_rows

    eng = make_tiny_engine()
    assert "not timed" in dict(model_rows(eng))["CPU matmuls"]
    eng.cpu_matmuls = cpu_matmuls.choose(eng.target, measure=costs([80.0, 110.0], [70.0, 100.0])[0])
    row = dict(model_rows(eng))["CPU matmuls"]
    assert row == eng.cpu_matmuls.describe() and row.startswith("OpenBLAS's gemm")


def test_the_environment_forces_either_untimed_and_a_bad_value_is_named(target, monkeypatch):
    from engine.doctor import model_rows
    from engine.errors import TandemError

    eng = make_tiny_engine()
    monkeypatch.setenv(cpu_matmuls.FORCE_ENV, "gemm")
    assert cpu_matmuls.choose(eng.target, measure=refuse) is None and not platform.skinny_active()
    assert dict(model_rows(eng))["CPU matmuls"] == "OpenBLAS's gemm for 1-14-row products (TANDEM_CPU_MATMULS=gemm)"
    monkeypatch.setenv(cpu_matmuls.FORCE_ENV, " Loops ")
    assert cpu_matmuls.choose(eng.target, measure=refuse) is None and platform.skinny_active()
    monkeypatch.setenv(cpu_matmuls.FORCE_ENV, "fast")
    with pytest.raises(TandemError, match="TANDEM_CPU_MATMULS='fast': use 'loops'"):
        cpu_matmuls.choose(eng.target, measure=refuse)
    assert "TANDEM_CPU_MATMULS='fast'" in dict(model_rows(eng))["CPU matmuls"]
    assert not cpu_matmuls._path().exists()


def test_cache_files_are_replaced_whole_or_not_at_all(tmp_path):
    """The calibration and matmul caches write through ``paths.write_json_atomic``: a write that
    fails leaves the old file as it was and no temp file behind."""
    from engine.paths import write_json_atomic

    path = tmp_path / "cache" / "choices.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})  # not JSON
    assert json.loads(path.read_text()) == {"a": 1}
    blocked = tmp_path / "cache" / "taken.json"
    (blocked / "inside").mkdir(parents=True)  # a folder where the file should go: the rename fails
    with pytest.raises(OSError):
        write_json_atomic(blocked, {"b": 2})
    assert sorted(p.name for p in path.parent.iterdir()) == ["choices.json", "taken.json"]  # no temp file
