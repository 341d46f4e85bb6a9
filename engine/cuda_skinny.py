"""Skinny matmuls on MLX's CUDA backend: a verify's 2-8 rows times a weight in one kernel.

MLX sends a one-row product (a decode step) to its own gemv kernel and every wider one to
cuBLAS. For the few rows of a verify, cuBLAS costs twice the gemv on an H200 (SmolLM2-135M in
fp16: the 210 products of one forward take 1.6 ms as gemv, 3.3 ms at 2, 4 or 8 rows; this
kernel 2.5, tests/device/verify_width.py) although the weights are read once either way: a
small target's forward is bound by latency per kernel, not by bandwidth. With the per-layer mask
conversion (engine/shapes.py ``additive``) that made a verify cost twice a plain step, so a
round had to keep ~1.4 drafts just to break even.

``skinny_matmul`` computes ``x @ w.T`` for 2-``MAX_ROWS`` rows with one warp per output column:
each lane streams 16-byte slices of the weight row and multiplies them into every input row, in
float32, then the warp sums its lanes. The weight is read once for all rows, as the gemv reads
it for one. Sums run in another order than cuBLAS's, so results differ from it in the last bits
(verify logits already differ from a step's that way; greedy output can change only at an exact
tie). The target swaps it in for 2-8-row forwards after a self-test against a float32 matmul and a
check of a verify's logits (``Target._install_skinny``); ``TANDEM_NO_CUDA_SKINNY=1`` turns it off.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 8
# Weights up to the starter's tied head (49152 x 576) were measured; larger ones are products a
# bandwidth-bound target spends its time in, where cuBLAS streams at full speed: they keep it.
MAX_WEIGHT = 1 << 25
THREADS = 256  # 8 warps (8 output columns) per block
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

_SOURCE = """
    constexpr int VEC = 16 / sizeof(T);
    const int rows = x_shape[0];
    const int N = w_shape[0];
    const int K = w_shape[1];
    const int lane = threadIdx.x & 31;
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (n >= N) {
        return;
    }
    const T* row = w + (size_t)n * K;
    float acc[MAX_ROWS];
    #pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
        acc[r] = 0.0f;
    }
    const bool aligned = K % VEC == 0 && ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(w)) & 15) == 0;
    if (aligned) {
        for (int k = lane * VEC; k < K; k += 32 * VEC) {
            T wv[VEC];
            *reinterpret_cast<uint4*>(wv) = *reinterpret_cast<const uint4*>(row + k);
            #pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) {
                if (r >= rows) {
                    break;
                }
                T xv[VEC];
                *reinterpret_cast<uint4*>(xv) = *reinterpret_cast<const uint4*>(x + (size_t)r * K + k);
                #pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    acc[r] += static_cast<float>(xv[j]) * static_cast<float>(wv[j]);
                }
            }
        }
    } else {
        for (int k = lane; k < K; k += 32) {
            const float wk = static_cast<float>(row[k]);
            #pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) {
                if (r >= rows) {
                    break;
                }
                acc[r] += static_cast<float>(x[(size_t)r * K + k]) * wk;
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
        if (r >= rows) {
            break;
        }
        float v = acc[r];
        #pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            v += __shfl_xor_sync(0xffffffff, v, offset);
        }
        if (lane == 0) {
            out[(size_t)r * N + n] = static_cast<T>(v);
        }
    }
"""


@lru_cache(maxsize=None)
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="tandem_skinny_matmul", input_names=["x", "w"], output_names=["out"],
                               source=_SOURCE)


def available() -> str:
    """"" when the kernel can run here, else why not."""
    if os.environ.get("TANDEM_NO_CUDA_SKINNY", "").strip() == "1":
        return "off: TANDEM_NO_CUDA_SKINNY=1"
    try:
        if not mx.cuda.is_available():
            return "off: not the CUDA backend"
    except AttributeError:
        return "off: MLX without CUDA"
    return ""


def takes(x: mx.array, w: mx.array) -> bool:
    """Whether ``x @ w.T`` is a product this kernel serves."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    return (2 <= rows <= MAX_ROWS and w.ndim == 2 and x.shape[-1] == w.shape[1] and w.size <= MAX_WEIGHT
            and x.dtype == w.dtype and w.dtype in DTYPES)


def skinny_matmul(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` for ``x`` [..., K] of 2-MAX_ROWS rows and ``w`` [N, K]."""
    rows, n = x.size // x.shape[-1], w.shape[0]
    out = _kernel()(inputs=[x.reshape(rows, x.shape[-1]), w], template=[("T", w.dtype), ("MAX_ROWS", MAX_ROWS)],
                    grid=(32 * n, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=[(rows, n)],
                    output_dtypes=[w.dtype])[0]
    return out.reshape(*x.shape[:-1], n)


def self_test(dtypes: tuple = DTYPES) -> str:
    """"" when the kernel matches a float32 matmul on every row count in ``dtypes``, else why not."""
    why = available()
    if why:
        return why
    return _self_test(tuple(sorted(dtypes, key=str)))


@lru_cache(maxsize=None)
def _self_test(dtypes: tuple) -> str:
    # Once per process and dtype set: a target and its draft model each install the kernel.
    try:
        for dtype in dtypes:
            for k, n in ((576, 1536), (100, 40)):  # vector loads, then the unaligned scalar path
                kx, kw = mx.random.split(mx.random.key(k))
                w = (mx.random.normal((n, k), key=kw) / k ** 0.5).astype(dtype)
                for rows in range(2, MAX_ROWS + 1):
                    x = mx.random.normal((1, rows, k), key=kx).astype(dtype)
                    want = (x.astype(mx.float32) @ w.astype(mx.float32).T)
                    got = skinny_matmul(x, w).astype(mx.float32)
                    gap = mx.abs(got - want).max().item()
                    limit = 1e-4 if dtype == mx.float32 else 2e-2 * max(1.0, mx.abs(want).max().item())
                    if not gap <= limit:
                        return f"off: self-test gap {gap:.3g} at {rows} rows, {k}x{n}, {dtype}"
    except Exception as e:  # no NVRTC, an old MLX without cuda_kernel, a compile error
        return f"off: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""


class Switch:
    """Whether swapped linears take the kernel (on for a target's 2-8-row forwards)."""

    def __init__(self) -> None:
        self.on = False


def _linear_call(switch: Switch, original: Callable) -> Callable:
    def call(self: nn.Linear, x: mx.array) -> mx.array:
        if switch.on and takes(x, self.weight):
            y = skinny_matmul(x, self.weight)
            return y + self.bias if "bias" in self else y
        return original(self, x)
    return call


def _head_call(switch: Switch, original: Callable) -> Callable:
    def as_linear(self: nn.Embedding, x: mx.array) -> mx.array:
        if switch.on and takes(x, self.weight):
            return skinny_matmul(x, self.weight)
        return original(self, x)
    return as_linear


@lru_cache(maxsize=None)
def _skinny_class(cls: type, switch: Switch) -> type:
    if issubclass(cls, nn.Linear):
        return type(f"Skinny{cls.__name__}", (cls,), {"__call__": _linear_call(switch, cls.__call__)})
    return type(f"Skinny{cls.__name__}", (cls,), {"as_linear": _head_call(switch, cls.as_linear)})


def swap_modules(model: nn.Module, switch: Switch) -> list[tuple[nn.Module, type]]:
    """Give every dense linear and embedding of ``model`` the switched kernel path (in place:
    names and parameters stay). Returns (module, original class) pairs for ``restore``."""
    swapped = []
    for _, module in model.named_modules():
        if type(module) in (nn.Linear, nn.Embedding):
            swapped.append((module, type(module)))
            module.__class__ = _skinny_class(type(module), switch)
    return swapped


def restore(swapped: list[tuple[nn.Module, type]]) -> None:
    for module, cls in swapped:
        module.__class__ = cls
