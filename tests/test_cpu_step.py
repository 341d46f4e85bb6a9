"""The CPU step's speed-ups change no result: compiled norms and ropes give bit-identical logits
and greedy ids (tiny models and the starter), a mismatching compile is refused, and the skinny
matmuls compute what gemm computes for every layout MLX sends them (up to a row past their
limit), and a row's sums do not depend on how many rows share the product or how many threads
split it."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine import compiled, platform, skinny_gemm
from engine.target import Target
from tests.tiny import make_tiny_engine, make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def greedy_steps(target: Target, prompt: list[int], steps: int, widths=(3, 1, 5)) -> tuple[list[int], list[mx.array]]:
    """Prefill, plain steps, then a few verify-width forwards (rolled back): ids and every logits row."""
    cache = target.new_cache()
    logits, _ = target.prefill(prompt, cache)
    ids, rows = [], [logits]
    for _ in range(steps):
        ids.append(mx.argmax(logits).item())
        out, _ = target.forward(mx.array([[ids[-1]]], dtype=mx.uint32), cache, last_only=True)
        logits = out[-1]
        rows.append(logits)
    for width in widths:
        out, _, txn = target.verify(mx.array([ids[-width:]], dtype=mx.uint32), cache)
        rows.append(out)
        mx.eval(out)
        txn.commit(1 if width == 1 else 0)  # a one-row forward keeps its row
    mx.eval(rows)
    return ids, rows


def assert_compiled_equals_plain(target: Target, prompt: list[int], steps: int) -> None:
    assert target.compiled_off == "", target.compiled_off
    fast_ids, fast_rows = greedy_steps(target, prompt, steps)
    target.compiled_off = "off for the comparison"
    try:
        plain_ids, plain_rows = greedy_steps(target, prompt, steps)
    finally:
        target.compiled_off = ""
    assert fast_ids == plain_ids
    for i, (a, b) in enumerate(zip(fast_rows, plain_rows)):
        assert a.shape == b.shape and mx.array_equal(a, b).item(), f"row {i} differs by {mx.abs(a - b).max().item()}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_small_forwards_are_bit_identical_on_tiny_models(arch):
    target = Target(make_tiny_model(arch, seed=5))
    counts = compiled.describe(target.model)
    assert counts.get("CompiledRMSNorm", 0) >= 2 * target.num_layers + 1
    assert counts.get("CompiledRoPE", 0) == target.num_layers
    assert_compiled_equals_plain(target, [3, 9, 4, 17, 4, 9, 3], steps=12)


def test_compiled_path_runs_only_inside_small_forwards():
    target = Target(make_tiny_model("llama", seed=6))
    seen = []
    original = compiled._rms_norm

    def spy(eps):
        seen.append(eps)
        return original(eps)

    compiled._rms_norm = spy
    try:
        cache = target.new_cache()
        target.forward(mx.array([list(range(2, 2 + compiled.MAX_WIDTH + 1))]), cache)  # a wide prefill chunk
        assert seen == []
        target.model(mx.array([[5]]), cache=cache)  # a direct model call (a draft model, a probe)
        assert seen == []
        target.forward(mx.array([[5]]), cache)
        assert len(seen) == 2 * target.num_layers + 1
    finally:
        compiled._rms_norm = original


def test_a_forward_computes_the_rope_angles_once_for_all_layers(monkeypatch):
    target = Target(make_tiny_model("llama", seed=9))
    ropes, rotations = [], []
    real_rope, real_rotate = compiled._rope, compiled._rotate_compiled
    monkeypatch.setattr(compiled, "_rope", lambda *a: ropes.append(a) or real_rope(*a))
    monkeypatch.setattr(compiled, "_rotate_compiled", lambda *a: rotations.append(a[0].shape) or real_rotate(*a))
    cache = target.new_cache()
    target.prefill([3, 9, 4, 17], cache)
    for width in (1, 3):
        ropes.clear(), rotations.clear()
        target.forward(mx.array([[5] * width]), cache)
        assert len(ropes) == 1  # the angles, once: every layer's q and k are rotated by them
        assert len(rotations) == 2 * target.num_layers and all(shape[-2] == width for shape in rotations)


def test_a_rope_over_part_of_the_head_keeps_its_own_compiled_path():
    model = make_tiny_model("llama", seed=10)
    for layer in model.model.layers:
        layer.self_attn.rope.dims //= 2  # before the Target: its probe checks this model
    target = Target(model)
    assert compiled.describe(model).get("CompiledRoPE") == target.num_layers
    assert_compiled_equals_plain(target, [3, 9, 4, 17, 4, 9, 3], steps=6)


def test_a_compile_that_changes_the_logits_is_refused(monkeypatch):
    monkeypatch.setattr(compiled, "_rms_norm", lambda eps: mx.compile(lambda x, w: mx.fast.rms_norm(x, w, eps) * 1.001))
    model = make_tiny_model("llama", seed=7)
    target = Target(model)
    assert target.compiled_off.startswith("compiled forward differs")
    assert compiled.describe(model) == {}  # the modules were put back
    assert type(model.model.norm) is nn.RMSNorm


def test_decode_is_unchanged_by_the_compiled_path():
    engine = make_tiny_engine("llama", seed=8)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    results = {}
    for label in ("compiled", "plain"):
        engine.target.compiled_off = "" if label == "compiled" else "off"
        results[label] = {mode: engine.generate(prompt, mode=mode, max_new_tokens=24).token_ids
                          for mode in ("baseline", "lookup")}
    engine.target.compiled_off = ""
    assert results["compiled"] == results["plain"]


@pytest.mark.slow
def test_compiled_step_is_bit_identical_on_the_starter(starter_engine):
    prompt = starter_engine.encode("Name three colours.")
    assert_compiled_equals_plain(starter_engine.target, prompt, steps=6)


# -- skinny matmuls -----------------------------------------------------------------------
needs_skinny = pytest.mark.skipif(not platform.skinny_active(),
                                  reason=f"skinny matmuls {platform.blas_status().skinny}")


@needs_skinny
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 8, 9, 12, 13, skinny_gemm.MAX_ROWS, skinny_gemm.MAX_ROWS + 1])
@pytest.mark.parametrize("layout", ["x@W.T", "x@W", "addmm", "batched", "strided"])
def test_skinny_matmuls_match_gemm_on_every_layout(layout, rows):
    rng = np.random.default_rng(rows)
    n, k = 700, 83  # k = 5 lanes of 16 and a tail of 3
    w, x, bias = (rng.standard_normal(s).astype(np.float32) for s in ((n, k), (rows, k), (n,)))
    cases = {
        "x@W.T": (lambda: mx.array(x) @ mx.array(w).T, x @ w.T),
        "x@W": (lambda: mx.array(x) @ mx.array(w.T.copy()), x @ w.T),
        "addmm": (lambda: mx.addmm(mx.array(bias), mx.array(x), mx.array(w).T), x @ w.T + bias),
        "batched": (lambda: mx.array(np.stack([x, 2 * x])) @ mx.array(w).T, np.stack([x @ w.T, 2 * x @ w.T])),
        "strided": (lambda: mx.array(np.concatenate([x, x], axis=1))[:, :k] @ mx.array(w).T, x @ w.T),
    }
    fn, want = cases[layout]
    got_skinny = np.array(fn())
    assert platform.skinny_matmuls(False) is False
    try:
        got_gemm = np.array(fn())
    finally:
        assert platform.skinny_matmuls(True) is True
    np.testing.assert_allclose(got_skinny, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_skinny, got_gemm, rtol=1e-5, atol=1e-5)


@needs_skinny
def test_a_row_does_not_depend_on_how_many_rows_share_the_product():
    """1-MAX_ROWS-row products sum each row the same way (every tile shape, row blocks past 12 rows),
    so a row is bit-identical in any of them: a decode step's row and the same row in a verify
    of any width get the same matmul sums."""
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((301, 99)).astype(np.float32))  # an odd column, a k tail
    x = mx.array(rng.standard_normal((skinny_gemm.MAX_ROWS, 99)).astype(np.float32))
    full = x @ w.T
    for rows in range(1, skinny_gemm.MAX_ROWS + 1):
        part = x[:rows] @ w.T
        assert mx.array_equal(part, full[:rows]).item(), rows
        assert mx.array_equal(x[rows - 1: rows] @ w.T, full[rows - 1: rows]).item(), rows  # alone, as a step


@needs_skinny
@pytest.mark.parametrize("layout", ["scores q@K.T", "values p@V"])
def test_attention_products_stay_in_the_own_loops_and_a_row_does_not_depend_on_the_width(layout):
    """Attention's products (a verify of 8 rows times 3 query heads a key head is 24 rows; keys or
    values a few hundred rows of 64) take the own loops at any width up to SMALL_ROWS rows, not
    OpenBLAS (whose threads would wake for them): they match numpy, and a row's result is
    bit-identical in every width, a decode step's included."""
    rng = np.random.default_rng(5)
    context, head = 301, 64
    rows = skinny_gemm.SMALL_ROWS
    if layout == "scores q@K.T":
        b = rng.standard_normal((context, head)).astype(np.float32)  # keys
        x = rng.standard_normal((rows, head)).astype(np.float32)
        product, want = (lambda a: a @ mx.array(b).T), x @ b.T
    else:
        b = rng.standard_normal((context, head)).astype(np.float32)  # values
        x = rng.random((rows, context)).astype(np.float32)  # probabilities, unnormalised
        product, want = (lambda a: a @ mx.array(b)), x @ b
    full = product(mx.array(x))
    np.testing.assert_allclose(np.array(full), want, rtol=1e-4, atol=1e-3)
    for width in (1, 2, 3, 8, 13, 24, 25, 40, rows):
        assert mx.array_equal(product(mx.array(x[:width])), full[:width]).item(), width
        assert mx.array_equal(product(mx.array(x[width - 1: width])), full[width - 1: width]).item(), width


@needs_skinny
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 13, skinny_gemm.MAX_ROWS])
def test_a_product_split_over_threads_is_bit_identical_to_one_thread(rows):
    """Threads take whole column ranges and run the one-thread code on them: every element is
    summed the same way, so a split changes no bit (an odd column count and a k tail included)."""
    rng = np.random.default_rng(rows)
    w = mx.array(rng.standard_normal((1537, 131)).astype(np.float32))
    x = mx.array(rng.standard_normal((rows, 131)).astype(np.float32))
    before, results = platform.skinny_threads(), {}
    try:
        for threads in (1, 2):
            assert platform.skinny_threads(threads) == threads
            splits = platform.skinny_splits()
            results[threads] = x @ w.T
            mx.eval(results[threads])
            assert platform.skinny_splits() - splits == (threads > 1)  # it really was split (or not)
    finally:
        platform.skinny_threads(before)
    assert mx.array_equal(results[1], results[2]).item()


@pytest.mark.skipif(not platform.blas_status().path, reason="no OpenBLAS")
def test_self_test_refuses_a_library_that_computes_something_else():
    real = skinny_gemm._SGEMM_FN(("cblas_sgemm", ctypes.CDLL(platform.blas_status().path)))

    def doubled(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        real(order, ta, tb, m, n, k, 2 * alpha, a, lda, b, ldb, beta, c, ldc)

    assert skinny_gemm.self_test(types.SimpleNamespace(cblas_sgemm=skinny_gemm._SGEMM_FN(real)), real) == ""
    problem = skinny_gemm.self_test(types.SimpleNamespace(cblas_sgemm=skinny_gemm._SGEMM_FN(doubled)), real)
    assert problem.startswith("self-test failed")


def run_py(code: str, **env: str) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_NO_SKINNY", "LD_PRELOAD")}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


STATUS = """
    import json, os
    import engine
    from engine import platform
    import mlx.core as mx
    st = platform.blas_status()
    built = sorted(os.listdir(os.path.join(os.environ["TANDEM_CACHE_DIR"], "blas"))) if os.path.isdir(
        os.path.join(os.environ["TANDEM_CACHE_DIR"], "blas")) else []
    x, w = mx.ones((1, 64)), mx.ones((300, 64))
    print(json.dumps(dict(state=st.state, skinny=st.skinny, active=platform.skinny_active(), built=built,
                          value=(x @ w.T)[0, 0].item())))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_skinny_library_builds_into_the_cache_and_can_be_turned_off(tmp_path):
    if platform.blas_status().state != "preloaded" or skinny_gemm._compiler() is None:
        pytest.skip(f"needs OpenBLAS preloaded and a C compiler ({platform.blas_status().skinny})")
    on = run_py(STATUS, TANDEM_CACHE_DIR=str(tmp_path))
    assert on["skinny"] == "on" and on["active"] and on["value"] == 64.0
    assert len(on["built"]) == 1 and on["built"][0].startswith("tandem-skinny-")
    again = run_py(STATUS, TANDEM_CACHE_DIR=str(tmp_path))  # reuses the cached library
    assert again["skinny"] == "on" and again["built"] == on["built"]
    off = run_py(STATUS, TANDEM_CACHE_DIR=str(tmp_path), TANDEM_NO_SKINNY="1")
    assert off["skinny"] == "off: TANDEM_NO_SKINNY is set" and not off["active"] and off["value"] == 64.0
    assert off["state"] == "preloaded"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_batched_forward_computes_each_rows_rope_angles_once_bit_identically(arch):
    """Rows of a batch at different lengths, in the batch's slot buffers and in a padded batch
    view: the compiled forward computes each row's rope angles once for every layer (one offsets
    array, ``slot_kv.row_offsets``) and still gives the plain forward's logits bit for bit."""
    from engine.slot_kv import Slots

    target = Target(make_tiny_model(arch, seed=5))
    prompts = [[3, 9, 4, 17], [5, 6, 7, 8, 9, 10, 11], [20, 21]]

    def forward(slotted: bool) -> mx.array:
        row_caches, slots = [], Slots()
        for p in prompts:
            cache = target.new_cache()
            target.prefill(p, cache)
            if slotted:
                slots.join(cache)
            row_caches.append(cache)
        logits, _ = target.forward_rows(mx.array([[12, 13]] * len(prompts), dtype=mx.uint32), row_caches)
        mx.eval(logits)
        return logits

    made = []
    angles = compiled.Switch.rope_angles

    def counted(self, rope, offset, rows, dtype):
        before = len(self._angles)
        out = angles(self, rope, offset, rows, dtype)
        if len(self._angles) > before:
            made.append(isinstance(offset, mx.array))
        return out

    compiled.Switch.rope_angles = counted
    try:
        for slotted in (True, False):
            made.clear()
            fast = forward(slotted)
            assert made.count(True) == 1  # the batched forward: one set of per-row angles for every layer
            target.compiled_off = "off for the comparison"
            try:
                plain = forward(slotted)
            finally:
                target.compiled_off = ""
            assert mx.array_equal(fast, plain).item(), mx.abs(fast - plain).max().item()
    finally:
        compiled.Switch.rope_angles = angles
