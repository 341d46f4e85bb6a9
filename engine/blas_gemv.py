"""Single-row float32 matmuls through BLAS gemv instead of gemm (Linux CPU backend).

MLX's CPU backend sends every float32 matmul to ``cblas_sgemm``, one token's step included
(M = 1). OpenBLAS's gemm packs the weight panel before it multiplies, so at M = 1 it moves the
weights twice and reads them at 3-4 GB/s, where ``cblas_sgemv`` streams them at 10-14 GB/s
(measured on this project's 2-core EPYC; OpenBLAS forwards gemm to gemv itself only on ARM64,
RISC-V and POWER). A plain decode step of SmolLM2-135M is 211 such products (540 MB).

The fix sits at the symbol MLX already resolves through the process's global scope, the way the
OpenBLAS preload does: a ~30-line C library exporting ``cblas_sgemm`` that forwards M = 1 calls
to OpenBLAS's ``cblas_sgemv`` and everything else to OpenBLAS's ``cblas_sgemm``. It is compiled
once with the system C compiler (MLX's own CPU ``mx.compile`` needs one too) into Tandem's cache
folder, loaded before OpenBLAS enters the global scope, and self-tested against gemm before it
is trusted. Without a compiler, or when the self-test fails, nothing changes.

gemv sums each dot product in a different order than gemm, so a one-row step and the same row of
a multi-row verify differ in the last bits of float32 (as they already did through attention):
the loop's greedy output can change only at an exact floating-point tie.
``TANDEM_NO_GEMV=1`` turns it off. Imports no MLX and no numpy (it runs before ``mlx.core``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.paths import cache_root

SOURCE = r"""
/* Tandem: cblas_sgemm that sends single-row products to cblas_sgemv (see engine/blas_gemv.py). */
#include <string.h>
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int gemv_on;
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

void tandem_gemv_bind(sgemm_fn gemm, sgemv_fn gemv) { real_sgemm = gemm; real_sgemv = gemv; gemv_on = 1; }
void tandem_gemv_enable(int on) { gemv_on = on && real_sgemv; }
int tandem_gemv_enabled(void) { return gemv_on; }

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  if (gemv_on && order == ROW_MAJOR && m == 1 && n > 0 && k > 0) {
    /* c[1, n] = alpha * a[1, k] op(b)[k, n] + beta * c: y = alpha * op(b)^T x + beta * y */
    int incx = trans_a == NO_TRANS ? 1 : lda;
    if (beta == 0.0f) memset(c, 0, sizeof(float) * (size_t)n); /* beta = 0 must ignore NaNs in c */
    if (trans_b == TRANS)
      real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    else
      real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    return;
  }
  real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""

_FLOAT_P = ctypes.POINTER(ctypes.c_float)
_INT = ctypes.c_int
_SGEMM_ARGS = [_INT, _INT, _INT, _INT, _INT, _INT, ctypes.c_float, _FLOAT_P, _INT, _FLOAT_P, _INT,
               ctypes.c_float, _FLOAT_P, _INT]
_SGEMM_FN = ctypes.CFUNCTYPE(None, *_SGEMM_ARGS)


def disabled() -> bool:
    return os.environ.get("TANDEM_NO_GEMV", "").strip() not in ("", "0")


def _compiler() -> str | None:
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library_path(compiler: str) -> Path:
    key = hashlib.sha256(f"{SOURCE}\0{compiler}\0{platform.machine()}".encode()).hexdigest()[:12]
    return cache_root() / "blas" / f"tandem-gemv-{key}.so"


def build() -> tuple[Path | None, str]:
    """The compiled library (built on first use, then cached), or None and why not."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc/gcc/clang) to build the gemv forwarder"
    out = library_path(compiler)
    if out.is_file():
        return out, ""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src, lib = Path(tmp) / "gemv.c", Path(tmp) / out.name
            src.write_text(SOURCE)
            done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)],
                                  capture_output=True, text=True, timeout=60)
            if done.returncode != 0 or not lib.is_file():
                first = (done.stderr.strip().splitlines() or ["no output"])[0]
                return None, f"building the gemv forwarder failed: {first}"
            os.replace(lib, out)  # atomic: a concurrent process sees the old file or the new one
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building the gemv forwarder failed: {e}"
    return out, ""


def _self_test(shim: ctypes.CDLL, real_sgemm: ctypes._CFuncPtr) -> str:
    """Compare the forwarder with OpenBLAS's gemm on single-row products of every layout MLX
    uses (b transposed or not, beta 0 over NaN garbage or 1). '' when they agree."""
    shim.cblas_sgemm.argtypes = _SGEMM_ARGS
    rng = random.Random(0)
    for n, k in ((37, 19), (96, 33)):
        for trans_b in (111, 112):
            for beta in (0.0, 1.0):
                a = (ctypes.c_float * k)(*[rng.uniform(-1, 1) for _ in range(k)])
                b = (ctypes.c_float * (n * k))(*[rng.uniform(-1, 1) for _ in range(n * k)])
                start = [float("nan") if beta == 0.0 else rng.uniform(-1, 1) for _ in range(n)]
                got, want = (ctypes.c_float * n)(*start), (ctypes.c_float * n)(*start)
                ldb = k if trans_b == 112 else n
                args = (101, 111, trans_b, 1, n, k, 1.0)
                shim.cblas_sgemm(*args, a, k, b, ldb, beta, got, n)
                real_sgemm(*args, a, k, b, ldb, beta, want, n)
                worst = max(abs(x - y) for x, y in zip(got, want))
                if not worst <= 1e-4 * max(1.0, max(abs(y) for y in want)):
                    return f"self-test failed (n={n}, k={k}, trans_b={trans_b}, beta={beta}: off by {worst})"
    return ""


def install(openblas_path: str) -> tuple[ctypes.CDLL | None, str]:
    """Build if needed and load the forwarder into the global scope, bound to the OpenBLAS at
    ``openblas_path`` (loaded here RTLD_LOCAL; the caller promotes it to RTLD_GLOBAL *after*, so
    the forwarder's ``cblas_sgemm`` is the one MLX finds). Returns (library, "") or (None, why)."""
    if disabled():
        return None, "TANDEM_NO_GEMV is set"
    lib_path, why = build()
    if lib_path is None:
        return None, why
    try:
        blas = ctypes.CDLL(openblas_path, mode=ctypes.RTLD_LOCAL)
        real_sgemm = _SGEMM_FN(("cblas_sgemm", blas))
        real_sgemv = ctypes.cast(blas.cblas_sgemv, ctypes.c_void_p)
        shim = ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
        shim.tandem_gemv_bind(ctypes.cast(real_sgemm, ctypes.c_void_p), real_sgemv)
    except (OSError, AttributeError) as e:
        return None, f"loading the gemv forwarder failed: {e}"
    problem = _self_test(shim, real_sgemm)
    if problem:
        shim.tandem_gemv_enable(0)  # loaded but a plain pass-through to gemm
        return None, problem
    return shim, ""
