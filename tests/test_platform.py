"""BLAS preload, backend facts and the doctor report.

The preload must happen before ``mlx.core`` is imported, which the test process has long done,
so those checks run in fresh subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from engine import doctor, platform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINUX = sys.platform.startswith("linux")
HAS_OPENBLAS = LINUX and any(os.path.exists(p) for p in platform.SYSTEM_OPENBLAS)


def run_py(code: str, unset: tuple[str, ...] = (), **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (without the ``unset`` variables); it must print one
    JSON object as its last line."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_NO_OPENBLAS", "LD_PRELOAD", *unset)}
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full_env,
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
    import json, sys, time
    {before}
    t = time.perf_counter()
    import engine  # preloads
    elapsed = time.perf_counter() - t
    from engine import platform
    st = platform.blas_status()
    mlx_after_preload = "mlx.core" in sys.modules
    import mlx.core as mx
    a = mx.random.normal((32, 576)); b = mx.random.normal((1536, 576)); mx.eval(a @ b.T)
    times = []
    for _ in range(5):
        t = time.perf_counter(); mx.eval(a @ b.T); times.append(time.perf_counter() - t)
    ms = min(times) * 1e3
    print(json.dumps(dict(state=st.state, path=st.path, reason=st.reason, elapsed=elapsed, ms=ms,
                          mlx_after_preload=mlx_after_preload, mapped=platform.mapped_blas_libraries())))
"""


@pytest.mark.skipif(not HAS_OPENBLAS, reason="system OpenBLAS (libopenblas0-pthread) not installed")
def test_preload_maps_openblas_before_mlx_and_is_cheap():
    r = run_py(PROBE.format(before=""))
    assert r["state"] == "preloaded" and "openblas" in r["path"]
    assert not r["mlx_after_preload"]  # importing engine must not import mlx
    assert r["elapsed"] < 0.5
    assert any("openblas" in os.path.basename(p) for p in r["mapped"])
    # The real proof: MLX's sgemm is fast (reference BLAS takes ~14 ms for this shape).
    assert r["ms"] < 5, r


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_preload_can_be_disabled():
    r = run_py(PROBE.format(before=""), TANDEM_NO_OPENBLAS="1")
    assert r["state"] == "disabled" and r["path"] is None
    assert not any("openblas" in os.path.basename(p) for p in r["mapped"])
    assert r["ms"] > 3, r  # the reference BLAS (~14 ms): the preload is what makes the difference


@pytest.mark.skipif(not HAS_OPENBLAS, reason="system OpenBLAS not installed")
def test_mlx_imported_first_is_reported():
    r = run_py(PROBE.format(before="import mlx.core"))
    assert r["state"] == "late" and "mlx.core was imported before" in r["reason"]


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_ld_preload_is_recognised():
    if not HAS_OPENBLAS:
        pytest.skip("system OpenBLAS not installed")
    lib = next(p for p in platform.SYSTEM_OPENBLAS if os.path.exists(p))
    r = run_py(PROBE.format(before=""), LD_PRELOAD=lib)
    assert r["state"] == "already-mapped" and r["ms"] < 5


def test_importing_engine_raises_the_cuda_graph_cache_unless_the_user_set_it():
    probe = """
        import json, os
        import engine
        print(json.dumps({"size": os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE")}))
    """
    assert run_py(probe, unset=("MLX_CUDA_GRAPH_CACHE_SIZE",))["size"] == str(platform.CUDA_GRAPH_CACHE)
    assert run_py(probe, MLX_CUDA_GRAPH_CACHE_SIZE="123")["size"] == "123"  # the user's choice stands
    rows = dict(doctor.doctor_report())
    assert rows["CUDA graph cache"].startswith(os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"])


def test_train_drafter_runs_with_mlx_s_own_graph_cache_unless_the_user_set_one():
    """Batched generation keeps large graphs: the raised cache ran the H200 out of memory."""
    probe = """
        import json, os
        import engine
        from engine.cli import train
        train.run_stages = lambda args: 0  # what train-drafter's run does first, and no more
        train.run(None)
        print(json.dumps({"size": os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE")}))
    """
    assert run_py(probe, unset=("MLX_CUDA_GRAPH_CACHE_SIZE",))["size"] == str(platform.MLX_GRAPH_CACHE)
    assert run_py(probe, MLX_CUDA_GRAPH_CACHE_SIZE="3000")["size"] == "3000"


def test_preload_is_idempotent_and_remembered():
    assert platform.preload_blas() is platform.preload_blas() is platform.blas_status()


def test_backend_facts():
    assert platform.backend() in ("metal", "cuda", "cpu")
    assert platform.prefers_dense_float32() is (platform.backend() == "cpu")
    assert platform.device_name().strip()
    assert platform.memory_bytes() > 256 * 2**20
    assert 0 < platform.available_memory_bytes() <= platform.memory_bytes()
    if LINUX and platform.backend() == "cpu":
        assert f"({os.cpu_count()} cores)" in platform.device_name()


def test_doctor_report():
    rows = dict(doctor.doctor_report())
    for label in ("Python", "mlx", "mlx-lm", "Backend", "Device", "Memory", "BLAS preload", "BLAS mapped",
                  "sgemm check", "CUDA graph cache", "Weights dtype", "Built-in models", "Converted cache",
                  "Prefix cache", "Suffix drafts", "HF cache"):
        assert label in rows and rows[label] and not rows[label].startswith("error"), (label, rows.get(label))
    assert rows["Backend"] == platform.backend()
    assert rows["BLAS preload"].startswith(platform.blas_status().state)
    assert "smollm2-135m: installed" in rows["Built-in models"]
    lines = doctor.format_doctor().splitlines()
    assert len(lines) == len(rows) and lines[0].startswith("Python ")
