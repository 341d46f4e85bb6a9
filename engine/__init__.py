"""Tandem's engine: lossless speculative decoding on MLX. No Qt in here.

Three layers; imports point down only (``tests/test_layout.py`` checks it):

* core: ``target`` (the model wrapper: taps, forward, prefill), ``compiled`` (its compiled small
  forwards on the CPU), ``cuda_skinny`` (its verifies' matmuls on CUDA), ``caches`` (cache
  transactions), ``recurrent`` (rewinding recurrent state), ``shapes`` (stable attention/verify
  shapes on CUDA), ``sampling``, ``speculative`` (the one verify loop),
  ``detokenize``, ``drafters/`` (one small class per drafter behind ``drafters.base.Drafter``), model
  loading (``loading``, ``gguf``, ``starter``) and ``platform`` + ``skinny_gemm`` (BLAS);
* orchestration: ``generate`` (``Engine``: prompts, drafters, streaming), ``prefix_cache`` +
  ``prefix_disk`` (stored prompt prefixes, in memory and on disk), ``modes``, ``registry``,
  ``calibrate`` + ``cost_model`` + ``cap_controller`` (cost curves, ``--max-draft auto``),
  ``cpu_matmuls`` (the skinny loops or OpenBLAS's gemm, timed per machine and model), ``warmup``,
  ``roofline``, ``benchmark`` + ``prompts`` (the shipped prompt sets), ``doctor``, ``options`` (the
  loading flags every front end shares) and ``api`` (the Python API);
* front ends: ``cli/`` (the ``tandem`` command), ``serve/`` (the local API server), ``train/``
  (``tandem train-drafter``); the desktop app (``app/``) sits beside them.

Importing the package preloads OpenBLAS on Linux (when installed) so that MLX's CPU backend
uses it instead of the reference BLAS its wheel ships, with ``skinny_gemm`` in front of it for
products of 1-14 rows; this must happen before the first ``import mlx.core`` anywhere in the process.
It also raises MLX's CUDA graph cache (``platform.cuda_defaults``) before any GPU work.
"""

from engine import platform as _platform

_platform.preload_blas()
_platform.cuda_defaults()

__version__ = "0.1.0"
