"""``tandem doctor``: what this machine and install look like, and why Tandem picks what it does.

Every row is (label, value). Nothing here raises: a probe that fails reports its error.
"""

from __future__ import annotations

import importlib.util
import os
import platform as _py_platform
import sys
import time
from importlib import metadata
from typing import Callable

from engine import platform
from engine.errors import TandemError


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "unknown"


def _blas_row() -> str:
    st = platform.blas_status()
    where = f" ({st.path})" if st.path else ""
    return f"{st.state}{where}: {st.reason}"


def _blas_mapped_row() -> str:
    if not sys.platform.startswith("linux"):
        return "n/a (Accelerate on macOS)"
    libs = platform.mapped_blas_libraries()
    return ", ".join(libs) if libs else "none found in /proc/self/maps"


def _sgemm_row() -> str:
    """Time one fp32 matmul of SmolLM2's MLP shape: reference BLAS ~14 ms, OpenBLAS ~0.5 ms."""
    import mlx.core as mx

    m, k, n = 32, 576, 1536
    with mx.stream(mx.cpu):
        a, b = mx.random.normal((m, k)), mx.random.normal((n, k))
        mx.eval(a, b, a @ b.T)  # warm-up
        times = []
        for _ in range(5):  # min, not mean: robust to other processes on a small machine
            start = time.perf_counter()
            mx.eval(a @ b.T)
            times.append(time.perf_counter() - start)
        ms = min(times) * 1e3
    verdict = "fast BLAS" if ms < 5 else "slow: reference BLAS?"
    return f"{ms:.2f} ms for {m}x{k}x{n} fp32 on CPU ({2 * m * k * n / ms / 1e6:.0f} GFLOP/s, {verdict})"


def _dtype_row() -> str:
    if platform.prefers_dense_float32():
        return ("dense float32: on MLX's CPU backend quantized matmul is ~3 GFLOP/s and linear in "
                "tokens, fp16 slower still; sgemm is the fast path")
    return f"as stored (quantized kept): {platform.backend()} has fast quantized kernels"


def _starter_row() -> str:
    from engine import starter

    rows = []
    for m in starter.list_builtin_models():
        rows.append(f"{m['name']}: {'installed' if m['installed'] else 'not installed'}")
    return "; ".join(rows)


def _kv_bits_row() -> str:
    from engine.modes import kv_bits_policy

    bits, why = kv_bits_policy(8)
    return "--kv-bits 4|8 available (QuantizedKVCache, group size 64)" if bits else why


def _rollback_row() -> str:
    from engine import recurrent

    return (f"{recurrent.default_method()} ({recurrent.METHOD_ENV}=states|replay): how a verify rewinds "
            f"recurrent state (Qwen3.5, Nemotron-H, LFM2...) to the accepted tokens")


def _shapes_row(target) -> str:
    if target.shapes is not None:
        return (f"stable: KV buffers in steps of {target.shapes.step} rows, verifies padded to "
                f"{'/'.join(map(str, target.shapes.widths))} (a backend compiling per shape builds each once)")
    if target.shapes_refused:
        return f"exact, the stable-shape policy refused: {target.shapes_refused} (expect compiles on a GPU)"
    from engine.shapes import default_policy

    if default_policy() is not None:
        return "exact: no full-attention KV cache to stabilize (only sliding windows or recurrent state)"
    return "exact (this backend compiles nothing per shape; TANDEM_STABLE_SHAPES=1 forces the policy)"


def model_rows(engine) -> list[tuple[str, str]]:
    """What a loaded model's caches are, and which modes it runs (or why not)."""
    rows = [("Model", engine.name), ("Images", images_row(engine)), ("Caches", engine.target.describe_caches()),
            ("Shapes", _shapes_row(engine.target)), ("Verify matmuls", _skinny_row(engine.target))]
    if platform.backend() == "cpu":
        rows.append(("CPU matmuls", _cpu_matmuls_row(engine)))
    if engine.kv_bits:
        rows.append(("KV bits", str(engine.kv_bits)))
    rows.append(("Calibration", _calibration_row(engine)))
    rows += [("Note", note) for note in engine.notes]
    if (norms := _mtp_norms_row(engine)) is not None:
        rows.append(("MTP norms", norms))
    for mode, reason in engine.mode_support().items():
        rows.append((f"--mode {mode}", "runs" if reason is None else reason))
    return rows


def _calibration_row(engine) -> str:
    """Which drafters ``--max-draft auto`` finds calibrated for this model on this machine."""
    from engine.calibrate import target_calibrations
    from engine.cost_model import static_cap

    found = sorted(target_calibrations(engine), key=lambda cal: cal.created)
    if not found:
        return ("none on this machine yet: a first --max-draft auto request measures it (tandem serve: "
                "between requests), or tandem calibrate --mode MODE now")
    return ", ".join(f"{cal.fields['drafter'].split(':')[0]} (default cap {static_cap(cal)}, measured "
                     f"{time.strftime('%Y-%m-%d', time.localtime(cal.created))})" for cal in found)


def _mtp_norms_row(engine) -> str | None:
    """How the model's own MTP head stores its norm weights (read from the values), if it has one."""
    from engine import registry
    from engine.drafters import formats

    return formats.describe_mtp_norms(registry.model_folder(engine), registry.model_config(engine))


def images_row(engine) -> str:
    """Whether the model takes images (a vision model loaded through mlx-vlm), or why not."""
    vision = getattr(engine, "vision", None)
    if vision is None:
        return "no (a text-only model)"
    if vision.takes_images:
        return f"yes ({vision.model_type} through mlx-vlm; the image enters the prefill, drafters work on the answer)"
    return f"no: {vision.refused}"


def _skinny_row(target) -> str:
    why = target.skinny_off
    return "Tandem's CUDA kernel for 2-8 rows (engine/cuda_skinny.py)" if not why else f"MLX's ({why})"


def _cpu_matmuls_row(engine) -> str:
    """Which matmuls this model's 1-14-row products run (engine/cpu_matmuls.py), and the times that chose them."""
    choice = getattr(engine, "cpu_matmuls", None)
    if choice is not None:
        return choice.describe()
    if not platform.skinny_installed():
        return f"OpenBLAS's gemm (Tandem's skinny loops {platform.blas_status().skinny})"
    from engine.cpu_matmuls import FORCE_ENV, forced_choice, pick_name

    try:
        if forced := forced_choice():
            return f"{pick_name(forced == 'loops')} for 1-14-row products ({FORCE_ENV}={forced})"
    except TandemError as e:  # doctor never raises: it reports
        return str(e)
    state = "on" if platform.skinny_active() else "off"
    return f"Tandem's skinny loops {state} for 1-14-row products (not timed: a small model, or not loaded by engine.api)"


def _cache_row() -> str:
    from engine.gguf import converted_root

    root = converted_root()
    n = sum(1 for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else 0
    return f"{root} ({n} converted model{'s' if n != 1 else ''})"


def _prefix_cache_row() -> str:
    from engine.prefix_cache import MEMORY_FRACTION, default_memory_bytes
    from engine.prefix_disk import default_dir

    root = default_dir()
    files = [p for p in root.rglob("*.safetensors") if not p.name.startswith((".", "suffix-"))] if root.is_dir() else []
    size = sum(p.stat().st_size for p in files)
    return (f"{_gib(default_memory_bytes())} in memory ({MEMORY_FRACTION:.0%} of {_gib(platform.available_memory_bytes())} "
            f"available; --prefix-cache-mb); disk tier with --prefix-cache-dir: {root} ({len(files)} entries, "
            f"{size / 2**20:.0f} MiB)")


def _suffix_drafts_row() -> str:
    from engine.drafters.suffix import DEFAULT_BUDGET_TOKENS
    from engine.prefix_disk import default_dir

    root = default_dir()
    files = list(root.rglob("suffix-*.safetensors")) if root.is_dir() else []
    return (f"on: lookup also drafts from earlier requests' prompts and outputs ({DEFAULT_BUDGET_TOKENS:,} tokens "
            f"per index, least recently used dropped; one index per API key in the server); kept across restarts "
            f"with --prefix-cache-dir ({len(files)} saved in {root}); --no-suffix-drafts turns it off")


def _hf_cache_row() -> str:
    from huggingface_hub import constants

    offline = " (offline mode)" if constants.HF_HUB_OFFLINE else ""
    return f"{constants.HF_HUB_CACHE}{offline}"


def _cuda_graph_row() -> str:
    size = os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE", "400 (MLX's default)")
    return size if platform.backend() == "cuda" else f"{size} (used on CUDA only)"


_PROBES: list[tuple[str, Callable[[], str]]] = [
    ("Python", lambda: f"{_py_platform.python_version()} ({sys.executable})"),
    ("OS", lambda: f"{_py_platform.system()} {_py_platform.release()} {_py_platform.machine()}"),
    ("mlx", lambda: _version("mlx")),
    ("mlx-lm", lambda: _version("mlx-lm")),
    ("mlx-vlm", lambda: _version("mlx-vlm") if importlib.util.find_spec("mlx_vlm") else
        "not installed (vision models: pip install 'mlx-tandem[vision]')"),
    ("Backend", platform.backend),
    ("Device", platform.device_name),
    ("Memory", lambda: _gib(platform.memory_bytes())),
    ("BLAS preload", _blas_row),
    ("BLAS mapped", _blas_mapped_row),
    ("Skinny matmuls", lambda: platform.blas_status().skinny),
    ("sgemm check", _sgemm_row),
    ("CUDA graph cache", _cuda_graph_row),
    ("Weights dtype", _dtype_row),
    ("KV cache bits", _kv_bits_row),
    ("Recurrent rollback", _rollback_row),
    ("Built-in models", _starter_row),
    ("Converted cache", _cache_row),
    ("Prefix cache", _prefix_cache_row),
    ("Suffix drafts", _suffix_drafts_row),
    ("HF cache", _hf_cache_row),
]


def doctor_report(model: str | None = None) -> list[tuple[str, str]]:
    """(label, value) rows describing versions, backend, BLAS, dtype policy, models and caches;
    with ``model``, also that model's caches and the modes it runs (or why it runs baseline)."""
    rows = []
    for label, probe in _PROBES:
        try:
            value = probe()
        except Exception as e:  # a doctor must not crash on the thing it diagnoses
            value = f"error: {type(e).__name__}: {e}"
        rows.append((label, str(value)))
    if os.environ.get("TANDEM_NO_OPENBLAS"):
        rows.append(("Note", "TANDEM_NO_OPENBLAS is set: OpenBLAS preload disabled"))
    if model is not None:
        try:
            from engine.api import load

            rows += model_rows(load(model or None))
        except Exception as e:
            rows.append(("Model", f"error: {type(e).__name__}: {e}"))
    return rows


def format_doctor(model: str | None = None) -> str:
    rows = doctor_report(model)
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
