# Thaw as an AWS Lambda container-image function (CPU; Lambda has no GPU).
#
# The entrypoint speaks the Lambda Runtime API itself when AWS_LAMBDA_RUNTIME_API
# is set (on Lambda, or under `thaw emulate`), and serves HTTP on $PORT otherwise,
# so the same image also runs as a plain container. No Lambda base image or
# runtime interface client is needed.
#
# Layers go from rarely to often changed: system, torch, other dependencies,
# code, bundles. A code change rebuilds only the last two.
#
#   docker build -t thaw .            (sam build does this from template.yaml)

FROM python:3.11.9-slim-bookworm

# torch is pinned, from the CPU wheel index (no CUDA libraries in a Lambda image).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/opt/thaw \
    THAW_BUNDLE_SOURCE=/opt/thaw/bundles \
    THAW_CACHE_DIR=/tmp/thaw-cache \
    THAW_STATE_DIR=/tmp/thaw-state \
    THAW_JOB_STORE=sqlite:////tmp/thaw-jobs.sqlite3

WORKDIR /opt/thaw

# Dependencies before code: torch first (largest), then pyproject's dependency list.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" \
    && rm /tmp/requirements.txt

# Lambda runs the image as its own unprivileged user; elsewhere this one is used.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin thaw

COPY runtime/ runtime/
COPY handlers/ handlers/
# PYTHONDONTWRITEBYTECODE and a read-only image would otherwise make every cold
# start compile Thaw from source (30-80 ms before /healthz).
RUN python -m compileall -q runtime handlers
# Bundles last: the largest and most often replaced layer.
COPY bundles/ bundles/

USER 10001
ENTRYPOINT ["python", "-m", "runtime"]
