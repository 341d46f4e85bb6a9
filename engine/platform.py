"""Platform facts: BLAS preload, MLX backend, device name, memory.

``preload_blas`` must stay cheap and must not import MLX: ``engine/__init__`` calls it before
anything imports ``mlx.core``. The ``mlx-cpu`` wheel links the netlib reference BLAS; loading
OpenBLAS into the global symbol scope first makes MLX's ``cblas_sgemm`` calls resolve to it
(dense float32 prefill goes from ~15 to ~350 tok/s on SmolLM2-135M, see spec/models.md §4).
Ahead of OpenBLAS goes ``engine.skinny_gemm``, which takes over products of 1-14 rows (a decode
step, a verify round): OpenBLAS's gemm packs the weights first and is 2-3x slower there.
"""

from __future__ import annotations

import ctypes
import glob
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

# System OpenBLAS (Debian/Ubuntu `libopenblas0-pthread`, then Fedora-style lib64).
SYSTEM_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
)
# pip-only fallback: opencv-python bundles an OpenBLAS with plain `cblas_sgemm`. numpy's and
# scipy's bundled copies use prefixed symbols and do NOT work.
OPENCV_OPENBLAS_GLOB = "opencv_python.libs/libopenblasp-r0-*.so*"


@dataclass(frozen=True)
class BlasStatus:
    """What ``preload_blas`` did. ``state`` is one of: preloaded, already-mapped, late,
    not-found, disabled, failed, not-linux. ``skinny``: "on" when 1-14-row matmuls bypass
    OpenBLAS's gemm (``engine.skinny_gemm``), else "off: <why>"."""

    state: str
    path: Optional[str]
    reason: str
    skinny: str = "off"

    @property
    def ok(self) -> bool:
        return self.state in ("preloaded", "already-mapped")


_BLAS_STATUS: Optional[BlasStatus] = None
_BLAS_HANDLE: Optional[ctypes.CDLL] = None  # keep the library referenced for the process life
_SKINNY_HANDLE: Optional[ctypes.CDLL] = None


def _openblas_candidates() -> list[str]:
    found = [p for p in SYSTEM_OPENBLAS if os.path.exists(p)]
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            found += sorted(glob.glob(os.path.join(entry, OPENCV_OPENBLAS_GLOB)))
    return found


def mapped_blas_libraries() -> list[str]:
    """Shared libraries with 'blas' in their name mapped into this process (Linux only)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "blas" in line.lower() and "/" in line}
    except OSError:
        return []
    return sorted(paths)


# MLX's CUDA backend replays kernels through CUDA graphs kept in a cache of 400 by default. A
# speculative session cycles through more topologies than that (plain steps, every verify width,
# the drafter's forwards, prefill chunks), and a thrashing cache rebuilds graphs on plain steps too:
# on the H200 the starter's baseline ran 3.7-7.9 ms a step in a benchmark process at 400, 3.2-5.0
# at 2000 (tests/device/results/README.md).
CUDA_GRAPH_CACHE = 2000
MLX_GRAPH_CACHE = 400  # MLX's own default
_GRAPH_CACHE_RAISED = False  # whether cuda_defaults set it (the user did not)


def cuda_defaults() -> str:
    """Raise MLX's CUDA graph cache (``MLX_CUDA_GRAPH_CACHE_SIZE``) unless the user set it. MLX
    reads it when a GPU stream first encodes work, so this runs when ``engine`` is imported.
    Harmless on Metal and the CPU backend. Returns the value in force."""
    global _GRAPH_CACHE_RAISED
    if "MLX_CUDA_GRAPH_CACHE_SIZE" not in os.environ:
        os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"] = str(CUDA_GRAPH_CACHE)
        _GRAPH_CACHE_RAISED = True
    return os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"]


def batch_defaults() -> str:
    """For batched work (``tandem train-drafter``), before any GPU work: MLX's own graph cache
    again, unless the user set one. A cached graph keeps its buffers, and a batch of 1024
    answers makes large ones: at 2000 the second wave of the starter's answers ran the H200
    out of memory (``tests/device/results/h200-train6-generate.log``). Returns the value in force."""
    global _GRAPH_CACHE_RAISED
    if _GRAPH_CACHE_RAISED:
        os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"] = str(MLX_GRAPH_CACHE)
        _GRAPH_CACHE_RAISED = False
    return os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE", str(MLX_GRAPH_CACHE))


def preload_blas() -> BlasStatus:
    """Load OpenBLAS with RTLD_GLOBAL before ``mlx.core`` is imported (Linux only).

    Idempotent; the result is remembered for ``blas_status()`` and ``tandem doctor``.
    ``TANDEM_NO_OPENBLAS=1`` disables it.
    """
    global _BLAS_STATUS, _BLAS_HANDLE
    if _BLAS_STATUS is not None:
        return _BLAS_STATUS
    _BLAS_STATUS = _preload_blas()
    return _BLAS_STATUS


def _preload_blas() -> BlasStatus:
    global _BLAS_HANDLE
    if not sys.platform.startswith("linux"):
        return BlasStatus("not-linux", None, f"not needed on {sys.platform} (Accelerate/Metal)")
    if os.environ.get("TANDEM_NO_OPENBLAS", "").strip() not in ("", "0"):
        return BlasStatus("disabled", None, "TANDEM_NO_OPENBLAS is set")
    mapped = [p for p in mapped_blas_libraries() if "openblas" in os.path.basename(p).lower()]
    if mapped:  # LD_PRELOAD or an earlier load already put it in the global scope
        return BlasStatus("already-mapped", mapped[0], "OpenBLAS was already loaded (LD_PRELOAD?)",
                          "off: OpenBLAS was in the global scope first")
    late = "mlx.core" in sys.modules
    candidates = _openblas_candidates()
    if not candidates:
        return BlasStatus(
            "not-found",
            None,
            "no OpenBLAS found; MLX uses its reference BLAS (apt-get install libopenblas0-pthread)",
        )
    errors = []
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)  # loads at all? (then engine.skinny_gemm goes first)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        skinny = "off: mlx.core was imported first" if late else _install_skinny(path)
        _BLAS_HANDLE = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        if late:
            # Loaded anyway (lazy binding may still pick it up), but nothing guarantees it.
            return BlasStatus(
                "late",
                path,
                "mlx.core was imported before engine, so MLX most likely keeps its reference BLAS "
                "(import engine first or set LD_PRELOAD)",
                skinny,
            )
        return BlasStatus("preloaded", path, "loaded with RTLD_GLOBAL before mlx.core", skinny)
    return BlasStatus("failed", None, "; ".join(errors))


def _install_skinny(openblas_path: str) -> str:
    """Put engine.skinny_gemm's ``cblas_sgemm`` in the global scope ahead of OpenBLAS's."""
    global _SKINNY_HANDLE
    from engine.skinny_gemm import install

    _SKINNY_HANDLE, why = install(openblas_path)
    return "on" if _SKINNY_HANDLE is not None else f"off: {why}"


def skinny_installed() -> bool:
    """Whether engine.skinny_gemm sits in front of OpenBLAS, its self-test passed (on or off:
    ``skinny_matmuls`` switches it)."""
    return _SKINNY_HANDLE is not None


def blas_build() -> str:
    """The preloaded OpenBLAS's build, kernel family and threads ('' without one): which products
    it packs depends on them (engine.cpu_matmuls keys its choice on it)."""
    if _BLAS_HANDLE is None:
        return ""
    out = []
    for name in ("openblas_get_config", "openblas_get_corename"):
        try:
            fn = getattr(_BLAS_HANDLE, name)
            fn.restype = ctypes.c_char_p
            out.append((fn() or b"").decode(errors="replace"))
        except AttributeError:
            pass
    try:
        out.append(f"{int(_BLAS_HANDLE.openblas_get_num_threads())} threads")
    except AttributeError:
        pass
    return ", ".join(out)


def skinny_active() -> bool:
    """Whether 1-14-row matmuls bypass OpenBLAS's gemm right now (costs differ: calibrations key on it)."""
    return _SKINNY_HANDLE is not None and bool(_SKINNY_HANDLE.tandem_skinny_enabled())


def skinny_label() -> str:
    """'skinny-<id of its source>' while the skinny matmuls are on, else '': a calibration keys on
    it, so a changed kernel (other costs) is measured again."""
    if not skinny_active():
        return ""
    from engine.skinny_gemm import source_id

    return f"skinny-{source_id()}"


def skinny_matmuls(on: bool) -> bool:
    """Switch engine.skinny_gemm on or off at run time (benchmarks compare both in one process).
    Returns whether it is on now; always False where it was not installed."""
    if _SKINNY_HANDLE is None:
        return False
    _SKINNY_HANDLE.tandem_skinny_enable(int(bool(on)))
    return skinny_active()


def skinny_threads(count: int = 0) -> int:
    """The threads a 1-14-row product is split over (``count`` > 0 sets it, at most 8; benchmarks
    and tests compare counts in one process). 0 where the skinny matmuls were not installed."""
    if _SKINNY_HANDLE is None:
        return 0
    return int(_SKINNY_HANDLE.tandem_skinny_threads(int(count)))


def skinny_splits() -> int:
    """How many products have been split over threads so far (0 where not installed)."""
    return int(_SKINNY_HANDLE.tandem_skinny_splits()) if _SKINNY_HANDLE is not None else 0


def blas_status() -> BlasStatus:
    """The remembered preload result (runs the preload if nobody did yet)."""
    return preload_blas()


@lru_cache(maxsize=1)
def backend() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: where MLX runs by default."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def prefers_dense_float32() -> bool:
    """True on the CPU backend: MLX's CPU quantized matmul runs at ~3 GFLOP/s, single-threaded,
    linear in the number of tokens, and fp16 is slower still, so dense float32 (BLAS sgemm)
    wins by far. On Metal/CUDA quantized weights are fast and save memory."""
    return backend() == "cpu"


def _cpu_name() -> str:
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True, text=True, timeout=5,
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    import platform as _stdlib_platform

    return _stdlib_platform.processor() or _stdlib_platform.machine() or "unknown CPU"


def _mx_device_info() -> dict:
    import mlx.core as mx

    for fn in (getattr(mx, "device_info", None), getattr(getattr(mx, "metal", None), "device_info", None)):
        if fn is None:
            continue
        try:
            return dict(fn())
        except Exception:  # older MLX or no such device
            continue
    return {}


def device_name() -> str:
    """CPU model (with core count) on the CPU backend; the GPU name on Metal/CUDA."""
    if backend() == "cpu":
        return f"{_cpu_name()} ({os.cpu_count()} cores)"
    name = _mx_device_info().get("device_name")
    return str(name) if name else backend()


def memory_bytes() -> int:
    """Physical memory usable by this process: RAM, capped by a cgroup limit if any."""
    total = 0
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    if not total:
        info = _mx_device_info()
        total = int(info.get("memory_size") or info.get("total_memory") or 0)
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit() and 0 < int(limit) < total:
            total = int(limit)
    return total


def available_memory_bytes() -> int:
    """Memory this process could still take without swapping: MemAvailable on Linux (within a
    cgroup limit), free + inactive pages on macOS; half the total when neither can be read."""
    total = memory_bytes()
    free = 0
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        free = int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open("/sys/fs/cgroup/memory.max") as f:
                limit = f.read().strip()
            with open("/sys/fs/cgroup/memory.current") as f:
                used = int(f.read().strip())
            if limit.isdigit():
                free = min(free or total, max(0, int(limit) - used))
        except (OSError, ValueError):
            pass
    elif sys.platform == "darwin":
        try:
            out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
            page = int(out.split("page size of")[1].split()[0]) if "page size of" in out else 4096
            pages = {k.strip(): int(v.strip().rstrip(".")) for k, v in
                     (line.split(":", 1) for line in out.splitlines()[1:] if ":" in line) if v.strip().rstrip(".").isdigit()}
            free = page * sum(pages.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages speculative"))
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    return free if free > 0 else total // 2
