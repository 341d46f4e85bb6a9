"""Tandem's engine: lossless speculative decoding on MLX. No Qt in here.

Importing the package preloads OpenBLAS on Linux (when installed) so that MLX's CPU backend
uses it instead of the reference BLAS its wheel ships; this must happen before the first
``import mlx.core`` anywhere in the process.
"""

from engine import platform as _platform

_platform.preload_blas()

__version__ = "0.1.0"
