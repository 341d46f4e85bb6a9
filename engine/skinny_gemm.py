"""Skinny float32 matmuls (1 to 8 rows times a weight matrix) without OpenBLAS's gemm packing.

MLX's CPU backend sends every float32 matmul to ``cblas_sgemm``: a decode step (1 row) and a
verify round (2-9 rows) included. OpenBLAS's gemm packs each weight panel before multiplying,
so for a few rows it moves the weights twice and reads them at 3-5 GB/s, where a plain stream
reaches 10-15 GB/s on the same machine (OpenBLAS forwards gemm to gemv itself only on ARM64,
RISC-V and POWER). SmolLM2-135M's step is 211 such products over 540 MB of weights.

The fix sits at the symbol MLX already resolves through the process's global scope, the way the
OpenBLAS preload does: a small C library exporting ``cblas_sgemm`` that sends

* 1-row products to OpenBLAS's ``cblas_sgemv`` (multi-threaded, streams the weights once);
* 2-8-row products ``a @ b.T`` (every ``nn.Linear`` and the tied head) to its own loop, which
  reads each weight row once for all rows (16-lane dot products, vectorized for this CPU);
* everything else (prefill, wide verifies, other layouts) to OpenBLAS's ``cblas_sgemm``.

It is compiled once with the system C compiler (MLX's CPU ``mx.compile`` needs one too; the
build is keyed on this CPU's flags since it uses ``-march=native``) into Tandem's cache folder,
loaded before OpenBLAS enters the global scope, and compared with gemm on every layout it takes
over before it is trusted. Without a compiler, or when the self-test fails, nothing changes.

The sums run in another order than gemm's, so results differ from gemm's in the last bits of
float32, as rows of different verify widths already did through attention: greedy output can
change only at an exact floating-point tie. ``TANDEM_NO_SKINNY=1`` turns it off. Imports no MLX
and no numpy: it runs before ``mlx.core`` is imported.
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

MAX_ROWS = 8  # the own loop's limit; from 9 rows gemm's packing pays for itself

SOURCE = r"""
/* Tandem's skinny float32 matmuls in front of OpenBLAS (see engine/skinny_gemm.py). */
#include <stddef.h>
#include <string.h>
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int on;
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, LANES = 16 };

void tandem_skinny_bind(sgemm_fn gemm, sgemv_fn gemv) { real_sgemm = gemm; real_sgemv = gemv; on = 1; }
void tandem_skinny_enable(int yes) { on = yes && real_sgemm && real_sgemv; }
int tandem_skinny_enabled(void) { return on; }

/* c[i, j] = sum_p a[i, p] b[j, p] (+ beta c[i, j]) for i < M, a constant once inlined: each row of b
   is read once for all M rows; each dot product is summed in 16 lanes, then the lanes in order. */
static inline void rows_nt(const int M, int n, int k, const float *restrict a, int lda,
                           const float *restrict b, int ldb, float beta, float *restrict c, int ldc) {
  for (int j = 0; j < n; j++) {
    const float *bj = b + (size_t)j * ldb;
    float acc[8][LANES];
    for (int i = 0; i < M; i++)
      for (int l = 0; l < LANES; l++) acc[i][l] = 0.0f;
    int p = 0;
    for (; p + LANES <= k; p += LANES)
      for (int i = 0; i < M; i++) {
        const float *ai = a + (size_t)i * lda + p;
        for (int l = 0; l < LANES; l++) acc[i][l] += ai[l] * bj[p + l];
      }
    for (int i = 0; i < M; i++) {
      const float *ai = a + (size_t)i * lda;
      float sum = 0.0f, tail = 0.0f;
      for (int q = p; q < k; q++) tail += ai[q] * bj[q];
      for (int l = 0; l < LANES; l++) sum += acc[i][l];
      float *cij = c + (size_t)i * ldc + j;
      *cij = beta == 0.0f ? sum + tail : sum + tail + beta * *cij;
    }
  }
}

static int few_rows(int m, int n, int k, const float *a, int lda, const float *b, int ldb, float beta,
                    float *c, int ldc) {
  switch (m) {
    case 2: rows_nt(2, n, k, a, lda, b, ldb, beta, c, ldc); return 1;
    case 3: rows_nt(3, n, k, a, lda, b, ldb, beta, c, ldc); return 1;
    case 4: rows_nt(4, n, k, a, lda, b, ldb, beta, c, ldc); return 1;
    case 5: rows_nt(5, n, k, a, lda, b, ldb, beta, c, ldc); return 1;
    case 6: rows_nt(6, n, k, a, lda, b, ldb, beta, c, ldc); return 1;
    case 7: rows_nt(7, n, k, a, lda, b, ldb, beta, c, ldc); return 1;
    case 8: rows_nt(8, n, k, a, lda, b, ldb, beta, c, ldc); return 1;
  }
  return 0;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  if (on && order == ROW_MAJOR && n > 0 && k > 0) {
    if (m == 1) { /* c = alpha * op(b)^T a + beta * c, as a matrix-vector product */
      int inc_a = trans_a == NO_TRANS ? 1 : lda;
      if (beta == 0.0f) memset(c, 0, sizeof(float) * (size_t)n); /* beta 0 must ignore NaNs in c */
      if (trans_b == TRANS)
        real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
      else
        real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
      return;
    }
    if (trans_a == NO_TRANS && trans_b == TRANS && alpha == 1.0f
        && few_rows(m, n, k, a, lda, b, ldb, beta, c, ldc))
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
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def disabled() -> bool:
    return os.environ.get("TANDEM_NO_SKINNY", "").strip() not in ("", "0")


def _compiler() -> str | None:
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    """The CPU's model and feature flags: a library built with -march=native is for this CPU only."""
    try:
        with open("/proc/cpuinfo") as f:
            keys = ("model name", "flags", "Features", "CPU part")
            return "".join(sorted({line for line in f if line.split(":")[0].strip() in keys}))
    except OSError:
        return ""


def library_path(compiler: str) -> Path:
    key = f"{SOURCE}\0{compiler}\0{platform.machine()}\0{_cpu_flags()}"
    return cache_root() / "blas" / f"tandem-skinny-{hashlib.sha256(key.encode()).hexdigest()[:12]}.so"


def build() -> tuple[Path | None, str]:
    """The compiled library (built on first use, then cached), or None and why not."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc/gcc/clang) to build it"
    out = library_path(compiler)
    if out.is_file():
        return out, ""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src, lib = Path(tmp) / "skinny.c", Path(tmp) / out.name
            src.write_text(SOURCE)
            for flags in (["-O3", "-march=native"], ["-O3"]):  # a compiler without -march=native: portable build
                done = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(lib), str(src)],
                                      capture_output=True, text=True, timeout=60)
                if done.returncode == 0:
                    break
            if done.returncode != 0 or not lib.is_file():
                first = (done.stderr.strip().splitlines() or ["no output"])[0]
                return None, f"building it failed: {first}"
            os.replace(lib, out)  # atomic: a concurrent process sees no file or the whole one
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building it failed: {e}"
    return out, ""


def _floats(rng: random.Random, n: int, nan: bool = False):
    return (ctypes.c_float * n)(*[float("nan") if nan else rng.uniform(-1, 1) for _ in range(n)])


def self_test(skinny, real_sgemm) -> str:
    """Compare ``skinny.cblas_sgemm`` with OpenBLAS's on the products it takes over: 1-8 rows,
    both layouts of b, beta 0 over NaN garbage and beta 1, strided rows, k with and without a
    tail. '' when every result is within float32 rounding of gemm's."""
    skinny.cblas_sgemm.argtypes = _SGEMM_ARGS
    rng = random.Random(0)
    for m, n, k, trans_b, beta in ((1, 37, 19, TRANS, 0.0), (1, 37, 19, NO_TRANS, 1.0), (1, 50, 33, TRANS, 1.0),
                                   (2, 37, 19, TRANS, 0.0), (3, 21, 48, TRANS, 1.0), (5, 9, 35, TRANS, 0.0),
                                   (8, 40, 64, TRANS, 0.0), (8, 17, 7, TRANS, 1.0), (4, 30, 20, NO_TRANS, 0.0)):
        lda, ldc = k + 3, n + 2  # strided rows
        ldb = k if trans_b == TRANS else n
        a, b = _floats(rng, m * lda), _floats(rng, n * k)
        start = _floats(rng, m * ldc, nan=beta == 0.0)
        got, want = (ctypes.c_float * len(start))(*start), (ctypes.c_float * len(start))(*start)
        args = (ROW_MAJOR, NO_TRANS, trans_b, m, n, k, 1.0, a, lda, b, ldb, beta)
        skinny.cblas_sgemm(*args, got, ldc)
        real_sgemm(*args, want, ldc)
        for i in range(m):
            row_got, row_want = got[i * ldc: i * ldc + n], want[i * ldc: i * ldc + n]
            worst = max(abs(x - y) for x, y in zip(row_got, row_want))
            if not worst <= 1e-5 * max(1.0, max(abs(y) for y in row_want)) * k:
                return f"self-test failed (m={m}, n={n}, k={k}, trans_b={trans_b}, beta={beta}: off by {worst})"
    return ""


def install(openblas_path: str) -> tuple[ctypes.CDLL | None, str]:
    """Build if needed and load the library into the global scope, bound to the OpenBLAS at
    ``openblas_path`` (loaded here RTLD_LOCAL; the caller promotes it to RTLD_GLOBAL *after*, so
    this library's ``cblas_sgemm`` is the one MLX finds). Returns (library, "") or (None, why)."""
    if disabled():
        return None, "TANDEM_NO_SKINNY is set"
    lib_path, why = build()
    if lib_path is None:
        return None, why
    try:
        blas = ctypes.CDLL(openblas_path, mode=ctypes.RTLD_LOCAL)
        real_sgemm = _SGEMM_FN(("cblas_sgemm", blas))
        real_sgemv = ctypes.cast(blas.cblas_sgemv, ctypes.c_void_p)
        skinny = ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
        skinny.tandem_skinny_bind(ctypes.cast(real_sgemm, ctypes.c_void_p), real_sgemv)
    except (OSError, AttributeError) as e:
        return None, f"loading it failed: {e}"
    problem = self_test(skinny, real_sgemm)
    if problem:
        skinny.tandem_skinny_enable(0)  # stays loaded, as a plain pass-through to gemm
        return None, problem
    return skinny, ""
