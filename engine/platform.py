"""Placeholder; replaced by the loader/doctor work (BLAS preload, backend facts)."""


def preload_blas() -> None:
    return None
