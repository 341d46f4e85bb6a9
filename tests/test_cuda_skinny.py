"""engine.cuda_skinny: which products take the CUDA kernel, the module swap that routes a target's
2-8-row forwards to it, and the load-time check that keeps it or refuses it.

The kernel itself runs only on MLX's CUDA backend (tests/device/verify_width.py measures it on
the H200 against cuBLAS and checks its logits); here it is stood in for by a plain matmul that
counts its calls, so the routing and the target's checks run on their real code paths.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine import cuda_skinny
from engine import target as target_module
from engine.doctor import model_rows
from engine.generate import Engine
from tests.tiny import make_tiny_model, make_tokenizer

IDS = [3, 8, 2, 9, 4, 7, 1, 5, 6, 12]


class StandIn:
    """``x @ w.T`` through MLX (optionally off by ``error``), counting calls by row count."""

    def __init__(self, error: float = 0.0):
        self.rows: list[int] = []
        self.error = error

    def __call__(self, x: mx.array, w: mx.array) -> mx.array:
        self.rows.append(x.size // x.shape[-1])
        return mx.matmul(x, w.T) + self.error


def tiny_engine() -> Engine:
    return Engine(make_tiny_model("llama", seed=1), make_tokenizer(), name="tiny")


def test_off_on_this_backend_and_by_the_environment(monkeypatch):
    if mx.cuda.is_available():
        pytest.skip("CUDA machine: the kernel is available here")
    assert cuda_skinny.available() == "off: not the CUDA backend"
    assert cuda_skinny.self_test() == "off: not the CUDA backend"  # the kernel is never launched
    monkeypatch.setenv("TANDEM_NO_CUDA_SKINNY", "1")
    assert cuda_skinny.available() == "off: TANDEM_NO_CUDA_SKINNY=1"
    eng = tiny_engine()
    assert eng.target.skinny_off == "not needed on cpu"
    assert dict(model_rows(eng))["Verify matmuls"] == "MLX's (not needed on cpu)"


def test_only_two_to_eight_rows_of_a_matching_dense_weight_are_taken():
    w = mx.zeros((16, 32), mx.bfloat16)
    for rows, taken in ((1, False), (2, True), (5, True), (8, True), (9, False)):
        assert cuda_skinny.takes(mx.zeros((1, rows, 32), mx.bfloat16), w) is taken, rows
    assert not cuda_skinny.takes(mx.zeros((1, 4, 32), mx.float16), w)  # another dtype
    assert not cuda_skinny.takes(mx.zeros((1, 4, 16), mx.bfloat16), w)  # another width
    assert not cuda_skinny.takes(mx.zeros((1, 4, 32), mx.uint32), mx.zeros((16, 32), mx.uint32))  # packed
    big = mx.zeros((cuda_skinny.MAX_WEIGHT // 32 + 1, 32), mx.bfloat16)  # past the measured sizes: cuBLAS
    assert not cuda_skinny.takes(mx.zeros((1, 4, 32), mx.bfloat16), big)
    assert cuda_skinny.takes(mx.zeros((1, 4, 32), mx.bfloat16), big[: cuda_skinny.MAX_WEIGHT // 32])


def test_swapped_modules_route_only_switched_forwards_and_restore(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(cuda_skinny, "skinny_matmul", stand_in)
    model = make_tiny_model("llama", seed=1)
    ids = mx.array([IDS[:4]])
    from mlx_lm.models.cache import make_prompt_cache

    before = model(ids, cache=make_prompt_cache(model))
    switch = cuda_skinny.Switch()
    swapped = cuda_skinny.swap_modules(model, switch)
    linears = sum(1 for _, m in model.named_modules() if isinstance(m, nn.Linear))
    assert len(swapped) == linears + 1  # every linear and the embedding (its head when tied)
    off = model(ids, cache=make_prompt_cache(model))
    assert stand_in.rows == [] and mx.array_equal(off, before).item()
    switch.on = True
    on = model(ids, cache=make_prompt_cache(model))
    assert stand_in.rows and set(stand_in.rows) == {4} and mx.allclose(on, before, atol=1e-5).item()
    calls = len(stand_in.rows)
    model(mx.array([IDS[:1]]), cache=make_prompt_cache(model))  # a step: MLX's gemv
    model(mx.array([IDS[:9]]), cache=make_prompt_cache(model))  # past MAX_ROWS: cuBLAS
    assert len(stand_in.rows) == calls
    cuda_skinny.restore(swapped)
    assert all(type(m) in (nn.Linear, nn.Embedding) for m, _ in swapped)
    switch.on = True
    model(ids, cache=make_prompt_cache(model))
    assert len(stand_in.rows) == calls


def as_cuda(monkeypatch, stand_in: StandIn) -> None:
    monkeypatch.setattr(target_module, "backend", lambda: "cuda")
    monkeypatch.setattr(cuda_skinny, "self_test", lambda dtypes=cuda_skinny.DTYPES: "")
    monkeypatch.setattr(cuda_skinny, "skinny_matmul", stand_in)


def test_a_target_on_cuda_runs_verifies_through_the_kernel_and_steps_through_mlx(monkeypatch):
    stand_in = StandIn()
    as_cuda(monkeypatch, stand_in)
    eng = tiny_engine()
    tgt = eng.target
    assert tgt.skinny_off == ""
    cache = tgt.new_cache()
    tgt.prefill(IDS[:6], cache)  # 6 rows: through the kernel too
    assert set(stand_in.rows) >= {6}
    stand_in.rows.clear()
    logits, _ = tgt.forward(mx.array([IDS[6:7]]), cache)  # a plain step
    mx.eval(logits)
    assert stand_in.rows == []
    logits, _ = tgt.forward(mx.array([IDS[:4]]), cache)  # a verify of 4 rows
    mx.eval(logits)
    assert stand_in.rows and set(stand_in.rows) == {4}
    calls = len(stand_in.rows)
    tgt.model(mx.array([IDS[:4]]), cache=tgt.new_cache())  # outside Target.forward: the switch is off
    assert len(stand_in.rows) == calls
    tgt.set_taps([1])  # the tap probe compares with the model's own call bit for bit: kernel off meanwhile
    assert tgt.tap_layers == (1,) and tgt.skinny_off == "" and len(stand_in.rows) == calls
    assert dict(model_rows(eng))["Verify matmuls"].startswith("Tandem's")


def test_a_kernel_whose_logits_stray_past_cublas_rounding_is_refused(monkeypatch):
    as_cuda(monkeypatch, StandIn(error=0.5))
    eng = tiny_engine()
    assert "from a step's" in eng.target.skinny_off
    assert all(type(m) in (nn.Linear, nn.Embedding) for _, m in eng.target.model.named_modules()
               if isinstance(m, (nn.Linear, nn.Embedding)))  # swapped back
    assert dict(model_rows(eng))["Verify matmuls"].startswith("MLX's (logits")
