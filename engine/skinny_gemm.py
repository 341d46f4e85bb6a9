"""Skinny float32 matmuls (1 to 14 rows times a weight matrix) without OpenBLAS's gemm packing.

MLX's CPU backend sends every float32 matmul to ``cblas_sgemm``: a decode step (1 row) and a
verify round (2 or more rows) included. OpenBLAS's gemm packs each weight panel before multiplying,
so for a few rows it moves the weights twice and reads them at 3-5 GB/s, where a plain stream
reaches 10-15 GB/s on the same machine (OpenBLAS forwards gemm to gemv itself only on ARM64,
RISC-V and POWER). SmolLM2-135M's step is 211 such products over 540 MB of weights.

The fix sits at the symbol MLX already resolves through the process's global scope, the way the
OpenBLAS preload does: a small C library exporting ``cblas_sgemm`` that sends

* 1-14-row products ``a @ b.T`` (every ``nn.Linear`` and the tied head) to its own loops: tiles
  of up to 12 rows times 2-8 weight rows whose sums stay in vector registers (sized for AVX-512,
  AVX2 or ARM64 at build time), each weight row read from memory once for all rows, the next
  tiles prefetched; each dot product summed in 16 lanes, then the lanes in order, whatever the
  tile, so a row's result is bit-identical in any 1-14-row product: a decode step's row and the
  same row inside a verify get the same matmul sums. Output columns are split over as many
  threads as OpenBLAS uses (a small pool that polls for up to a millisecond, then sleeps; a
  product under ~128 KB of weights stays on the calling thread); every output element is
  computed by the same code whichever thread gets it, so a split product is bit-identical to the
  one-thread loop;
* products small enough for one thread (up to 64 rows times up to 256K floats of b: attention's
  scores ``q @ K.T`` and values ``p @ V``, 24 rows in a verify of 8 with 3 query heads a key
  head) to the same loops, or for ``a @ b`` to a row-blocked loop of its own, on the calling
  thread: given to OpenBLAS, they woke its threads, which then spun against this pool and MLX's
  thread (on 2 cores the starter's step at 256 tokens of context took 53.5 ms instead of 40.7); each
  row is summed the same way in any of them, so attention too is bit-identical across widths;
* other 1-row layouts to OpenBLAS's ``cblas_sgemv``;
* everything else (prefill, verifies of more than 14 rows, other layouts) to OpenBLAS's
  ``cblas_sgemm``.

It is compiled once with the system C compiler (MLX's CPU ``mx.compile`` needs one too; the
build is keyed on this CPU's flags since it uses ``-march=native``) into Tandem's cache folder,
loaded before OpenBLAS enters the global scope, and compared with gemm on every layout it takes
over (and a split product with the one-thread loop, bit for bit) before it is trusted. Without
a compiler, or when the self-test fails, nothing changes.

The sums run in another order than gemm's, so results differ from gemm's in the last bits of
float32, as rows of different verify widths already did through attention: greedy output can
change only at an exact floating-point tie. ``TANDEM_NO_SKINNY=1`` turns it off. A CPU or an
OpenBLAS build with a small-matrix path of its own can still make gemm the faster one:
``engine.cpu_matmuls`` times both on each model's forwards, once per machine, and keeps the
faster. Imports no MLX and no numpy: it runs before ``mlx.core`` is imported.
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

MAX_ROWS = 14  # the own loops' limit: in a whole forward OpenBLAS's gemm is as fast from 16 rows, 15-20 % faster at 32
# Products of up to SMALL_ROWS rows and SMALL_B floats of b stay in the own loops on the calling thread:
# attention's (3 query heads a key head times 8 verify rows is 24 rows; keys or values up to 4096 x 64)
SMALL_ROWS = 64
SMALL_B = 1 << 18
SPIN_NS = 1_000_000  # pool threads poll this long for the next product before they sleep
MAX_THREADS = 8  # the C side's limit on the threads one product is split over

SOURCE = r"""
/* Tandem's skinny float32 matmuls in front of OpenBLAS (see engine/skinny_gemm.py). */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int on;
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, LANES = 16 };
enum { MAX_ROWS = @MAX_ROWS@, MAX_THREADS = @MAX_THREADS@, MIN_SPLIT = 1 << 15, /* weights (floats) worth waking a thread for */
       SMALL_ROWS = @SMALL_ROWS@, SMALL_B = @SMALL_B@, /* attention's: up to these rows and floats of b */
       AHEAD = 4 };                          /* tiles of b columns prefetched ahead of the one in use */

void tandem_skinny_bind(sgemm_fn gemm, sgemv_fn gemv) { real_sgemm = gemm; real_sgemv = gemv; on = 1; }
void tandem_skinny_enable(int yes) { on = yes && real_sgemm && real_sgemv; }
int tandem_skinny_enabled(void) { return on; }

/* c[i, j] = sum_p a[i, p] b[j, p] (+ beta c[i, j]): a tile of R rows of a times C rows of b (the
   weights, read once from memory per tile; a's rows stay in L1), R and C constants so the R x C
   sums live in vector registers. Each sum runs in 16 lanes along p (lane l takes p = l, l + 16,
   ...), then the lanes in order, then the p tail: the same code for every tile shape, so a row's
   result is the same in any product of 1-MAX_ROWS rows, and on any thread. */
#if defined(__AVX512F__)
#define VEC 16
#elif defined(__AVX__)
#define VEC 8
#else
#define VEC 4 /* ARM64 NEON, SSE */
#endif
enum { PARTS = LANES / VEC }; /* a sum's 16 lanes in native vectors: lanes 0..VEC-1 in part 0, ... */
typedef float vec __attribute__((vector_size(VEC * sizeof(float))));
static inline vec ldv(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }

static inline __attribute__((always_inline)) void tile(const int R, const int C, int k,
    const float *restrict a, int lda, const float *restrict b, int ldb, float beta, float *restrict c,
    int ldc, const float *next) {
  vec acc[12][8][PARTS], w[8][PARTS]; /* fixed sizes (not R x C): the used ones stay in registers */
#pragma GCC unroll 12
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int q = 0; q < C; q++)
#pragma GCC unroll 4
      for (int s = 0; s < PARTS; s++) acc[r][q][s] = (vec){0};
  int p = 0;
  for (; p + LANES <= k; p += LANES) {
#pragma GCC unroll 8
    for (int q = 0; q < C; q++)
#pragma GCC unroll 4
      for (int s = 0; s < PARTS; s++) w[q][s] = ldv(b + (size_t)q * ldb + p + s * VEC);
    if (next) {
#pragma GCC unroll 8
      /* into L2, not as non-temporal: on Intel's server cores that hint fills L1 only, where four
         tiles ahead no longer fit, and the loops read 5 GB/s a thread instead of 14 */
      for (int q = 0; q < C; q++) __builtin_prefetch(next + (size_t)q * ldb + p, 0, 2);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
      for (int s = 0; s < PARTS; s++) {
        vec x = ldv(a + (size_t)r * lda + p + s * VEC);
#pragma GCC unroll 8
        for (int q = 0; q < C; q++) acc[r][q][s] += x * w[q][s];
      }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int q = 0; q < C; q++) {
      const float *ai = a + (size_t)r * lda, *bj = b + (size_t)q * ldb;
      float sum = 0.0f, tail = 0.0f;
      for (int t = p; t < k; t++) tail += ai[t] * bj[t];
#pragma GCC unroll 4
      for (int s = 0; s < PARTS; s++)
#pragma GCC unroll 16
        for (int l = 0; l < VEC; l++) sum += acc[r][q][s][l];
      float *cij = c + (size_t)r * ldc + q;
      *cij = beta == 0.0f ? sum + tail : sum + tail + beta * *cij;
    }
}

/* The tiles, one function each (so the compiler builds each once): WIDE[r] is the tile for a
   product of r <= TILE_ROWS rows, as many columns as the registers hold; NARROW[r] the tiles of
   more rows, in row blocks of TILE_ROWS (and one of r) over NARROW_COLS columns; SINGLE[r] the
   last n % C columns. */
typedef void (*tile_fn)(int, const float *, int, const float *, int, float, float *, int, const float *);
#define DEFINE_TILE(R, C) \
  static void tile_##R##x##C(int k, const float *a, int lda, const float *b, int ldb, float beta, float *c, \
                             int ldc, const float *next) { tile(R, C, k, a, lda, b, ldb, beta, c, ldc, next); }
#define NAME_TILE(R, C) tile_##R##x##C,
#if VEC == 16 /* AVX-512: 32 registers of 16 lanes */
enum { TILE_ROWS = 12, NARROW_COLS = 2 };
#define WIDE_TILES(X) X(1, 8) X(2, 6) X(3, 4) X(4, 4) X(5, 4) X(6, 3) X(7, 3) X(8, 3) X(9, 2) X(10, 2) X(11, 2) X(12, 2)
#define NARROW_ONLY(X) X(1, 2) X(2, 2) X(3, 2) X(4, 2) X(5, 2) X(6, 2) X(7, 2) X(8, 2)
#define NARROW_TILES(X) NARROW_ONLY(X) X(9, 2) X(10, 2) X(11, 2) X(12, 2)
#define SINGLE_TILES(X) X(1, 1) X(2, 1) X(3, 1) X(4, 1) X(5, 1) X(6, 1) X(7, 1) X(8, 1) X(9, 1) X(10, 1) X(11, 1) X(12, 1)
#elif VEC == 8 /* AVX2: 16 registers of 8 lanes, a sum takes two */
enum { TILE_ROWS = 3, NARROW_COLS = 2 };
#define WIDE_TILES(X) X(1, 4) X(2, 3) X(3, 2)
#define NARROW_ONLY(X) X(1, 2) X(2, 2)
#define NARROW_TILES(X) NARROW_ONLY(X) X(3, 2)
#define SINGLE_TILES(X) X(1, 1) X(2, 1) X(3, 1)
#else /* 128-bit vectors, a sum takes four */
enum { TILE_ROWS = 2, NARROW_COLS = 2 };
#define WIDE_TILES(X) X(1, 4) X(2, 2)
#define NARROW_ONLY(X) X(1, 2)
#define NARROW_TILES(X) NARROW_ONLY(X) X(2, 2)
#define SINGLE_TILES(X) X(1, 1) X(2, 1)
#endif
WIDE_TILES(DEFINE_TILE) NARROW_ONLY(DEFINE_TILE) SINGLE_TILES(DEFINE_TILE)
static const tile_fn WIDE[] = {NULL, WIDE_TILES(NAME_TILE)};
static const tile_fn NARROW[] = {NULL, NARROW_TILES(NAME_TILE)};
static const tile_fn SINGLE[] = {NULL, SINGLE_TILES(NAME_TILE)};
static const int WIDE_COLS[] = {0,
#define COLS_OF(R, C) C,
  WIDE_TILES(COLS_OF)
#undef COLS_OF
};

/* All m rows against C columns of b at a time (each column block read from memory once, its
   row blocks after the first from L1), the first row block prefetching the columns AHEAD blocks
   on; the last n % C columns one at a time. */
static void loop_rows(int m, int n, int k, const float *a, int lda, const float *b, int ldb, float beta,
                      float *c, int ldc) {
  const int one_block = m <= TILE_ROWS, rows = one_block ? m : TILE_ROWS, rest = one_block ? 0 : m % TILE_ROWS;
  const int cols = one_block ? WIDE_COLS[m] : NARROW_COLS;
  const tile_fn full = one_block ? WIDE[m] : NARROW[TILE_ROWS], part = rest ? NARROW[rest] : NULL;
  int j = 0;
  for (; j + cols <= n; j += cols) {
    const float *bj = b + (size_t)j * ldb;
    const float *next = j + cols * (AHEAD + 1) <= n ? bj + (size_t)cols * AHEAD * ldb : NULL;
    int i = 0;
    for (; i + rows <= m; i += rows)
      full(k, a + (size_t)i * lda, lda, bj, ldb, beta, c + (size_t)i * ldc + j, ldc, i ? NULL : next);
    if (part) part(k, a + (size_t)i * lda, lda, bj, ldb, beta, c + (size_t)i * ldc + j, ldc, NULL);
  }
  for (; j < n; j++)
    for (int i = 0; i < m; i += rows)
      SINGLE[m - i < rows ? m - i : rows](k, a + (size_t)i * lda, lda, b + (size_t)j * ldb, ldb, beta,
                                          c + (size_t)i * ldc + j, ldc, NULL);
}

/* c = a @ b (+ beta c) with b row-major k x n (attention's probabilities times its values): blocks of
   NT_ROWS rows of a against NT_VECS vectors of b's columns at a time, the sums in registers. Each
   c[i, j] starts at beta c[i, j] (0 for beta 0) and adds a[i, p] b[p, j] for p in order, in
   whichever block row i lands, so a row's result is the same in any product. */
enum { NT_ROWS = VEC == 16 ? 8 : 4, NT_VECS = 2 };
static void loop_rows_nt(int m, int n, int k, const float *a, int lda, const float *b, int ldb, float beta,
                         float *c, int ldc) {
  const int cols = NT_VECS * VEC;
  for (int i0 = 0; i0 < m; i0 += NT_ROWS) {
    const int rows = m - i0 < NT_ROWS ? m - i0 : NT_ROWS;
    int j = 0;
    for (; j + cols <= n; j += cols) {
      vec acc[NT_ROWS][NT_VECS];
      for (int r = 0; r < rows; r++)
        for (int v = 0; v < NT_VECS; v++)
          acc[r][v] = beta == 0.0f ? (vec){0} : beta * ldv(c + (size_t)(i0 + r) * ldc + j + v * VEC);
      for (int p = 0; p < k; p++) {
        vec w[NT_VECS];
        for (int v = 0; v < NT_VECS; v++) w[v] = ldv(b + (size_t)p * ldb + j + v * VEC);
        for (int r = 0; r < rows; r++) {
          const float x = a[(size_t)(i0 + r) * lda + p];
          for (int v = 0; v < NT_VECS; v++) acc[r][v] += x * w[v];
        }
      }
      for (int r = 0; r < rows; r++)
        memcpy(c + (size_t)(i0 + r) * ldc + j, acc[r], sizeof acc[r]);
    }
    for (; j < n; j++)
      for (int r = 0; r < rows; r++) {
        float *cij = c + (size_t)(i0 + r) * ldc + j, sum = beta == 0.0f ? 0.0f : beta * *cij;
        for (int p = 0; p < k; p++) sum += a[(size_t)(i0 + r) * lda + p] * b[(size_t)p * ldb + j];
        *cij = sum;
      }
  }
}

/* A product small enough for one thread (attention's, at any verify width): kept off OpenBLAS,
   whose threads, woken for it, would spin against this library's pool and MLX's own thread on the
   same cores (the starter's decode step at 256 tokens of context: 53.5 ms against 40.7). */
static int small_product(int m, int n, int k, int trans_b, const float *a, int lda, const float *b, int ldb,
                         float beta, float *c, int ldc) {
  if (m < 1 || m > SMALL_ROWS || (size_t)n * (size_t)k > SMALL_B || (trans_b != TRANS && trans_b != NO_TRANS))
    return 0;
  if (trans_b == TRANS)
    loop_rows(m, n, k, a, lda, b, ldb, beta, c, ldc);
  else
    loop_rows_nt(m, n, k, a, lda, b, ldb, beta, c, ldc);
  return 1;
}

/* -- the same loop over column ranges on several threads ----------------------------------------
   Each output c[i, j] is computed by the same code whichever thread runs column j, so a split
   product is bit-identical to the one-thread loop. Workers poll briefly between products (a verify
   forward issues ~200 in a row), then sleep on a condition variable. */
static struct {
  int m, n, k, lda, ldb, ldc, parts, chunk;
  const float *a, *b;
  float beta;
  float *c;
  unsigned fp_control; /* the caller's rounding and denormal modes, for the workers to match */
} job;
static int threads = 1;   /* parts a product may be split into, the caller's own included */
static int workers;       /* pool threads started (parts - 1 of them take part in a job) */
static atomic_uint epoch; /* bumped to hand out a job */
static atomic_int pending; /* workers that have not finished (or skipped) the current job */
static atomic_flag pool_busy = ATOMIC_FLAG_INIT; /* one caller at a time; others loop alone */
static long splits;        /* products split so far (tests and benchmarks read it) */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, finished = PTHREAD_COND_INITIALIZER;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* How long a thread polls before it sleeps. Between a decode step's products the gap is tiny, but
   between steps it is the graph build of the next one: a worker asleep by then pays a wake-up on
   every product of the next step. Timed, not counted: a pause costs 10 to 140 cycles by CPU. */
enum { SPIN_NS = @SPIN_NS@ };
typedef struct { unsigned polls; long long until; } spin_budget;
static inline long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}
/* One pause; true once this wait has polled for SPIN_NS (the clock read every 256 polls). */
static inline int spun_out(spin_budget *b) {
  relax();
  if (++b->polls % 256) return 0;
  long long t = now_ns();
  if (!b->until) b->until = t + SPIN_NS;
  return t > b->until;
}

static unsigned fp_control_get(void) {
#if defined(__x86_64__) || defined(__i386__)
  return _mm_getcsr() & ~0x3fu; /* the modes, without the exception flags */
#elif defined(__aarch64__)
  unsigned long r;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(r));
  return (unsigned)r;
#else
  return 0;
#endif
}

static void fp_control_set(unsigned v) {
  if (v == fp_control_get()) return;
#if defined(__x86_64__) || defined(__i386__)
  _mm_setcsr(v | (_mm_getcsr() & 0x3fu));
#elif defined(__aarch64__)
  unsigned long r = v;
  __asm__ __volatile__("msr fpcr, %0" : : "r"(r));
#endif
}

static void run_part(int part) {
  int j0 = part * job.chunk, j1 = j0 + job.chunk < job.n ? j0 + job.chunk : job.n;
  if (j0 < j1)
    loop_rows(job.m, j1 - j0, job.k, job.a, job.lda, job.b + (size_t)j0 * job.ldb, job.ldb, job.beta,
              job.c + j0, job.ldc);
}

static unsigned born[MAX_THREADS]; /* the epoch each worker was started in */

static void *worker(void *arg) {
  int part = (int)(size_t)arg; /* 1 .. MAX_THREADS - 1; the caller runs part 0 */
  unsigned seen = born[part];   /* a job handed out before this thread runs is still its own */
  for (;;) {
    unsigned now = seen;
    spin_budget spin = {0, 0};
    while ((now = atomic_load(&epoch)) == seen && !spun_out(&spin)) {}
    if (now == seen) {
      pthread_mutex_lock(&lock);
      while ((now = atomic_load(&epoch)) == seen) pthread_cond_wait(&wake, &lock);
      pthread_mutex_unlock(&lock);
    }
    seen = now;
    if (part < job.parts) {
      fp_control_set(job.fp_control);
      run_part(part);
    }
    if (atomic_fetch_sub(&pending, 1) == 1) { /* the last one out wakes the caller if it sleeps */
      pthread_mutex_lock(&lock);
      pthread_cond_signal(&finished);
      pthread_mutex_unlock(&lock);
    }
  }
  return NULL;
}

static void forget_pool(void) { /* in a fork's child: the workers did not come along */
  workers = 0;
  atomic_store(&pending, 0);
  atomic_flag_clear(&pool_busy);
  pthread_mutex_init(&lock, NULL);
  pthread_cond_init(&wake, NULL);
  pthread_cond_init(&finished, NULL);
}

/* Sets how many parts a product may be split into (n > 0, at most MAX_THREADS); returns the count. */
int tandem_skinny_threads(int n) {
  if (n > 0) {
    while (atomic_flag_test_and_set(&pool_busy)) relax();
    threads = n < MAX_THREADS ? n : MAX_THREADS;
    atomic_flag_clear(&pool_busy);
  }
  return threads;
}

long tandem_skinny_splits(void) { return splits; }

static int start_workers(int want) { /* called holding pool_busy */
  static int hooked;
  if (!hooked) hooked = pthread_atfork(NULL, NULL, forget_pool) == 0;
  while (workers < want) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    born[workers + 1] = atomic_load(&epoch);
    int failed = pthread_create(&t, &attr, worker, (void *)(size_t)(workers + 1));
    pthread_attr_destroy(&attr);
    if (failed) break;
    workers++;
  }
  return workers;
}

static int few_rows(int m, int n, int k, const float *a, int lda, const float *b, int ldb, float beta,
                    float *c, int ldc) {
  if (m < 1 || m > MAX_ROWS) return 0;
  size_t work = (size_t)n * (size_t)k;
  int parts = threads;
  if (work / MIN_SPLIT < (size_t)parts) parts = (int)(work / MIN_SPLIT);
  if (n / LANES < parts) parts = n / LANES;
  if (parts < 2 || atomic_flag_test_and_set(&pool_busy)) { /* small, one thread, or the pool is in use */
    loop_rows(m, n, k, a, lda, b, ldb, beta, c, ldc);
    return 1;
  }
  parts = 1 + (start_workers(parts - 1) < parts - 1 ? workers : parts - 1);
  int chunk = (n + parts - 1) / parts;
  chunk = (chunk + LANES - 1) / LANES * LANES; /* whole cache lines of c per part */
  job.m = m; job.n = n; job.k = k; job.a = a; job.lda = lda; job.b = b; job.ldb = ldb; job.beta = beta;
  job.c = c; job.ldc = ldc; job.parts = parts; job.chunk = chunk; job.fp_control = fp_control_get();
  splits += parts > 1;
  atomic_store(&pending, workers);
  pthread_mutex_lock(&lock);
  atomic_fetch_add(&epoch, 1);
  pthread_cond_broadcast(&wake);
  pthread_mutex_unlock(&lock);
  run_part(0);
  spin_budget spin = {0, 0};
  while (atomic_load(&pending) > 0 && !spun_out(&spin)) {}
  if (atomic_load(&pending) > 0) {
    pthread_mutex_lock(&lock);
    while (atomic_load(&pending) > 0) pthread_cond_wait(&finished, &lock);
    pthread_mutex_unlock(&lock);
  }
  atomic_flag_clear(&pool_busy);
  return 1;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  if (on && order == ROW_MAJOR && n > 0 && k > 0) {
    if (trans_a == NO_TRANS && trans_b == TRANS && alpha == 1.0f
        && few_rows(m, n, k, a, lda, b, ldb, beta, c, ldc))
      return;
    if (trans_a == NO_TRANS && alpha == 1.0f && small_product(m, n, k, trans_b, a, lda, b, ldb, beta, c, ldc))
      return;
    if (m == 1) { /* c = alpha * op(b)^T a + beta * c, as a matrix-vector product */
      int inc_a = trans_a == NO_TRANS ? 1 : lda;
      if (beta == 0.0f) memset(c, 0, sizeof(float) * (size_t)n); /* beta 0 must ignore NaNs in c */
      if (trans_b == TRANS)
        real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
      else
        real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
      return;
    }
  }
  real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""
for _name in ("MAX_ROWS", "SMALL_ROWS", "SMALL_B", "SPIN_NS", "MAX_THREADS"):  # one value for both sides
    SOURCE = SOURCE.replace(f"@{_name}@", str(globals()[_name]))

_FLOAT_P = ctypes.POINTER(ctypes.c_float)
_INT = ctypes.c_int
_SGEMM_ARGS = [_INT, _INT, _INT, _INT, _INT, _INT, ctypes.c_float, _FLOAT_P, _INT, _FLOAT_P, _INT,
               ctypes.c_float, _FLOAT_P, _INT]
_SGEMM_FN = ctypes.CFUNCTYPE(None, *_SGEMM_ARGS)
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def source_id() -> str:
    """A short id of the C source (a changed kernel changes the costs calibrations measured)."""
    return hashlib.sha256(SOURCE.encode()).hexdigest()[:8]


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
    """Compare ``skinny.cblas_sgemm`` with OpenBLAS's on the products it takes over: 1-MAX_ROWS rows,
    small products of up to SMALL_ROWS, both layouts of b, beta 0 over NaN garbage and beta 1,
    strided rows, k with and without a tail. '' when every result is within float32 rounding of
    gemm's."""
    skinny.cblas_sgemm.argtypes = _SGEMM_ARGS
    rng = random.Random(0)
    for m, n, k, trans_b, beta in ((1, 37, 19, TRANS, 0.0), (1, 37, 19, NO_TRANS, 1.0), (1, 50, 33, TRANS, 1.0),
                                   (2, 37, 19, TRANS, 0.0), (3, 21, 48, TRANS, 1.0), (5, 9, 35, TRANS, 0.0),
                                   (8, 40, 64, TRANS, 0.0), (8, 17, 7, TRANS, 1.0), (4, 30, 20, NO_TRANS, 0.0),
                                   (6, 33, 50, TRANS, 1.0), (11, 9, 40, TRANS, 0.0), (12, 20, 35, TRANS, 0.0),
                                   (13, 11, 40, TRANS, 1.0), (MAX_ROWS, 19, 33, TRANS, 0.0), (13, 10, 17, TRANS, 0.0),
                                   (24, 37, 19, TRANS, 0.0), (40, 21, 48, TRANS, 1.0), (3, 37, 19, NO_TRANS, 0.0),
                                   (24, 70, 33, NO_TRANS, 0.0), (SMALL_ROWS, 40, 17, NO_TRANS, 1.0)):
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


def split_test(skinny) -> str:
    """A product split over two threads must equal the one-thread loop bit for bit: every output
    element is computed by the same code whichever thread gets its column. '' when it does."""
    m, n, k = 3, 530, 131  # two threads' worth of weights; n not a multiple of 16, k with a tail
    rng = random.Random(1)
    a = _floats(rng, m * k)
    rows = bytes(_floats(rng, 17 * k))  # weights: 17 random rows repeated (fast to make)
    b = (ctypes.c_float * (n * k)).from_buffer_copy((rows * (n // 17 + 1))[: n * k * 4])
    before = skinny.tandem_skinny_threads(0)
    out = []
    try:
        for threads in (1, 2):
            skinny.tandem_skinny_threads(threads)
            c = (ctypes.c_float * (m * n))()
            skinny.cblas_sgemm(ROW_MAJOR, NO_TRANS, TRANS, m, n, k, 1.0, a, k, b, k, 0.0, c, n)
            out.append(bytes(c))
    finally:
        skinny.tandem_skinny_threads(before)
    return "" if out[0] == out[1] else "self-test failed: a product split over threads differs from the one-thread loop"


def blas_threads(blas: ctypes.CDLL) -> int:
    """The threads OpenBLAS uses (its OPENBLAS_NUM_THREADS / core count), at most MAX_THREADS."""
    try:
        count = int(blas.openblas_get_num_threads())
    except AttributeError:
        count = os.cpu_count() or 1
    return max(1, min(count, MAX_THREADS))


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
    problem = self_test(skinny, real_sgemm) or split_test(skinny)
    skinny.tandem_skinny_threads(blas_threads(blas))
    if problem:
        skinny.tandem_skinny_enable(0)  # stays loaded, as a plain pass-through to gemm
        return None, problem
    return skinny, ""
